"""nanoGPT's sample.py: sample from a trained model (a ckpt.pt run folder) or from GPT-2."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pydantic

from jaxport.errors import JaxportError
from jaxport.gpt.configurator import configure
from jaxport.gpt.data import gpt2_encoding, load_meta
from jaxport.gpt.model import GPT
from jaxport.gpt.trainer import compute_dtype, load_trained_model, select_devices
from jaxport.typed_config import validate


class FlagRanges(pydantic.BaseModel):
    """What sample.py's numbers may be (nanoGPT divides the logits by the temperature)."""

    model_config = pydantic.ConfigDict(extra="allow")
    num_samples: pydantic.PositiveInt
    max_new_tokens: pydantic.NonNegativeInt
    temperature: pydantic.confloat(gt=0, allow_inf_nan=False)
    top_k: pydantic.PositiveInt | None


DEFAULTS = dict(
    init_from="resume",  # or gpt2, gpt2-medium, gpt2-large, gpt2-xl
    out_dir="out",
    start="\n",  # or "<|endoftext|>", or "FILE:prompt.txt"
    num_samples=10,
    max_new_tokens=500,
    temperature=0.8,
    top_k=200,
    seed=1337,
    device="cuda",
    dtype="bfloat16",
    compile=False,
    data_dir="data",
    tokenizer_dir="",  # jaxport's: data root for meta.pkl, offline GPT-2 BPE files
)


def char_codec(meta: dict, path: Path):
    stoi, itos = meta["stoi"], meta["itos"]

    def encode(text: str) -> list[int]:
        unknown = sorted(set(text) - set(stoi))
        if unknown:
            raise JaxportError(f"the prompt has characters outside the vocabulary of {path}: {unknown}")
        return [stoi[c] for c in text]

    return encode, lambda ids: "".join(itos[i] for i in ids)


def load_codec(model: GPT, train_config: dict, cfg: dict):
    """meta.pkl's characters when the run's dataset has one (data/<dataset>/ as nanoGPT looks,
    then the run folder), GPT-2 BPE otherwise; a vocabulary the model lacks is an error."""
    candidates = []
    if cfg["init_from"] == "resume":
        if "dataset" in train_config:
            candidates.append(Path(cfg["data_dir"]) / train_config["dataset"] / "meta.pkl")
        candidates.append(Path(cfg["out_dir"]) / "meta.pkl")
    for path in candidates:
        meta = load_meta(path)
        if meta is not None:
            print(f"Loading meta from {path}...")
            if int(meta["vocab_size"]) != model.config.vocab_size:
                raise JaxportError(
                    f"vocab mismatch: {path} has vocab_size {meta['vocab_size']} but the "
                    f"checkpoint's model has vocab_size {model.config.vocab_size}"
                )
            return char_codec(meta, path)
    print("No meta.pkl found, assuming GPT-2 encodings...")
    enc = gpt2_encoding(cfg["tokenizer_dir"] or None)
    if model.config.vocab_size < enc.n_vocab:
        raise JaxportError(
            f"no meta.pkl found for this run ({', '.join(map(str, candidates))}) and its vocab_size "
            f"{model.config.vocab_size} is smaller than GPT-2's {enc.n_vocab}"
        )
    return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode


def sample(cfg: dict) -> list[str]:
    devices = select_devices(cfg["device"])
    if cfg["init_from"] == "resume":
        model, train_config = load_trained_model(cfg["out_dir"])
    elif cfg["init_from"].startswith("gpt2"):
        model, train_config = GPT.from_pretrained(cfg["init_from"], dict(dropout=0.0)), {}
    else:
        raise JaxportError(f"--init_from={cfg['init_from']}: use resume or gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    model.dtype = compute_dtype(cfg["dtype"], devices[0].platform)
    encode, decode = load_codec(model, train_config, cfg)
    start = cfg["start"]
    if start.startswith("FILE:"):
        path = Path(start[5:])
        if not path.is_file():
            raise JaxportError(f"--start=FILE:{path}: file not found")
        start = path.read_text(encoding="utf-8")
    start_ids = encode(start)
    if not start_ids:
        raise JaxportError("--start is empty: give at least one token of prompt")
    # all samples in one batch; each row draws its own tokens
    x = jax.device_put(np.tile(np.asarray(start_ids, np.int32), (cfg["num_samples"], 1)), devices[0])
    y = model.generate(
        x, cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"], rng=jax.random.key(cfg["seed"])
    )
    texts = [decode(row.tolist()) for row in np.asarray(y)]
    for text in texts:
        print(text)
        print("---------------")
    return texts


def main(argv: list[str]) -> int:
    cfg = configure(argv, DEFAULTS, nullable=("top_k",))
    validate(FlagRanges, cfg, "the sampling flags", what="flag")
    sample(cfg)
    return 0
