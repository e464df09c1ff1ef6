"""nanoGPT's data folders: `train.bin`/`val.bin` (raw uint16 ids) and, for characters, `meta.pkl`.

`prepare_*` write byte-identical files to nanoGPT's data/*/prepare.py; `Batches` is
train.py's `get_batch` (random windows of block_size + 1 ids).
"""

from __future__ import annotations

import os
import pickle
import urllib.request
from pathlib import Path

import numpy as np

from jaxport.checkpoint import atomic_write
from jaxport.errors import JaxportError

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
GPT2_FILES_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main"
GPT2_FILE_SHA256 = {  # the hashes tiktoken pins for OpenAI's files
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def read_text(out_dir: Path, input_file: str | os.PathLike | None, url: str = SHAKESPEARE_URL) -> str:
    """The corpus: `input_file` when given, else out_dir/input.txt, downloaded from `url`
    first if missing (as nanoGPT's prepare.py does)."""
    if input_file is not None:
        path = Path(input_file)
        if not path.is_file():
            raise JaxportError(f"input file not found: {path}")
    else:
        path = out_dir / "input.txt"
        if not path.exists():
            print(f"downloading {url} to {path}")
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    data = response.read()
            except OSError as err:
                raise JaxportError(f"cannot download {url} ({err}); pass a local copy with --input FILE") from None
            out_dir.mkdir(parents=True, exist_ok=True)
            with atomic_write(path) as tmp:
                tmp.write_bytes(data)
    return path.read_text(encoding="utf-8")


def _write_ids(ids, path: Path) -> None:
    with atomic_write(path) as tmp:
        np.asarray(ids, dtype=np.uint16).tofile(tmp)


def prepare_char(text: str, out_dir: str | os.PathLike) -> dict:
    """Character-level ids (vocabulary = sorted distinct characters), 90/10 split, meta.pkl."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"length of dataset in characters: {len(text):,}")
    chars = sorted(set(text))
    vocab_size = len(chars)
    print("all the unique characters:", "".join(chars))
    print(f"vocab size: {vocab_size:,}")
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    n = len(text)
    train_ids = [stoi[c] for c in text[: int(n * 0.9)]]
    val_ids = [stoi[c] for c in text[int(n * 0.9) :]]
    print(f"train has {len(train_ids):,} tokens")
    print(f"val has {len(val_ids):,} tokens")
    _write_ids(train_ids, out_dir / "train.bin")
    _write_ids(val_ids, out_dir / "val.bin")
    meta = {"vocab_size": vocab_size, "itos": itos, "stoi": stoi}
    with atomic_write(out_dir / "meta.pkl") as tmp, open(tmp, "wb") as f:
        pickle.dump(meta, f)
    return {"train": len(train_ids), "val": len(val_ids), "vocab_size": vocab_size}


def gpt2_encoding(tokenizer_dir: str | os.PathLike | None = None):
    """tiktoken's `gpt2` encoding. With `tokenizer_dir` (or $JAXPORT_GPT2_TOKENIZER) it is built
    from that folder's encoder.json and vocab.bpe, checked against OpenAI's hashes, offline."""
    import tiktoken

    tokenizer_dir = tokenizer_dir or os.environ.get("JAXPORT_GPT2_TOKENIZER")
    if tokenizer_dir is None:
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as err:  # network errors come in many types
            raise JaxportError(
                f"cannot load tiktoken's gpt2 encoding ({type(err).__name__}); offline, put "
                f"encoder.json and vocab.bpe from {GPT2_FILES_URL} in a folder and pass "
                f"--tokenizer_dir=FOLDER (or set JAXPORT_GPT2_TOKENIZER)"
            ) from None
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    folder = Path(tokenizer_dir)
    for name in GPT2_FILE_SHA256:
        if not (folder / name).is_file():
            raise JaxportError(f"GPT-2 tokenizer file missing: {folder / name} (get it from {GPT2_FILES_URL}/{name})")
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(folder / "vocab.bpe"),
            str(folder / "encoder.json"),
            vocab_bpe_hash=GPT2_FILE_SHA256["vocab.bpe"],
            encoder_json_hash=GPT2_FILE_SHA256["encoder.json"],
        )
    except ValueError as err:
        raise JaxportError(f"GPT-2 tokenizer files in {folder} are not OpenAI's: {err}") from None
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )


def prepare_bpe(text: str, out_dir: str | os.PathLike, enc) -> dict:
    """GPT-2 BPE ids of a 90/10 character split, each part encoded on its own (no <|endoftext|>)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(text)
    train_ids = enc.encode_ordinary(text[: int(n * 0.9)])
    val_ids = enc.encode_ordinary(text[int(n * 0.9) :])
    print(f"train has {len(train_ids):,} tokens")
    print(f"val has {len(val_ids):,} tokens")
    _write_ids(train_ids, out_dir / "train.bin")
    _write_ids(val_ids, out_dir / "val.bin")
    return {"train": len(train_ids), "val": len(val_ids), "vocab_size": enc.n_vocab}


def read_documents(source: str | os.PathLike) -> list[str]:
    """Documents of a local corpus: a .jsonl file (a "text" field per line), a folder of
    .txt files (one document each), or a text file (documents separated by blank lines)."""
    import json

    path = Path(source)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise JaxportError(f"corpus folder {path} has no .txt files")
        return [f.read_text(encoding="utf-8") for f in files]
    if not path.is_file():
        raise JaxportError(f"input file not found: {path}")
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    docs.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    raise JaxportError(f'{path}:{n} is not a JSON object with a "text" field') from None
        return docs
    return [d for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]


def prepare_openwebtext(out_dir: str | os.PathLike, enc, input_source=None, num_proc: int = 8) -> dict:
    """nanoGPT's data/openwebtext/prepare.py: every document encoded with encode_ordinary and
    followed by <|endoftext|>, 0.05% of the documents (seed 2357) held out as val. The corpus
    is Hugging Face's `openwebtext` through `datasets`, or a local one (see read_documents)."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if input_source is None:
        try:
            import datasets
        except ImportError:
            raise JaxportError(
                "preparing openwebtext needs the `datasets` package (pip install datasets) "
                "and network access, or a local corpus: --input FILE.jsonl|FILE.txt|FOLDER"
            ) from None
        split = datasets.load_dataset("openwebtext", num_proc=num_proc)["train"].train_test_split(
            test_size=0.0005, seed=2357, shuffle=True
        )
        splits = {"train": split["train"]["text"], "val": split["test"]["text"]}
    else:
        docs = read_documents(input_source)
        order = np.random.default_rng(2357).permutation(len(docs))
        n_val = max(1, round(len(docs) * 0.0005)) if len(docs) > 1 else 0
        splits = {"train": [docs[i] for i in order[n_val:]], "val": [docs[i] for i in order[:n_val]]}
    counts = {}
    for name, docs in splits.items():
        total = 0
        with atomic_write(out_dir / f"{name}.bin") as tmp, open(tmp, "wb") as f:
            for doc in tqdm(docs, desc=f"writing {name}.bin", unit="doc"):
                ids = enc.encode_ordinary(doc)
                ids.append(enc.eot_token)
                f.write(np.asarray(ids, np.uint16).tobytes())
                total += len(ids)
        counts[name] = total
        print(f"{name} has {total:,} tokens")
    return {**counts, "vocab_size": enc.n_vocab}


def prepare(
    dataset: str, out_dir: str | os.PathLike | None = None, input_file=None, tokenizer: str = "char", tokenizer_dir=None
) -> dict:
    """`jaxport gpt prepare`: shakespeare_char, shakespeare (GPT-2 BPE), openwebtext (GPT-2 BPE,
    documents ended by <|endoftext|>) or text (any local file)."""
    out_dir = Path(out_dir or Path("data") / dataset)
    if dataset == "openwebtext":
        return prepare_openwebtext(out_dir, gpt2_encoding(tokenizer_dir), input_file)
    if dataset == "shakespeare_char":
        return prepare_char(read_text(out_dir, input_file), out_dir)
    if dataset == "shakespeare":
        return prepare_bpe(read_text(out_dir, input_file), out_dir, gpt2_encoding(tokenizer_dir))
    if dataset == "text":
        if input_file is None:
            raise JaxportError("`prepare text` needs --input FILE (a UTF-8 text file)")
        text = read_text(out_dir, input_file)
        if tokenizer == "char":
            return prepare_char(text, out_dir)
        if tokenizer == "gpt2":
            return prepare_bpe(text, out_dir, gpt2_encoding(tokenizer_dir))
        raise JaxportError(f"unknown tokenizer {tokenizer!r}: use char or gpt2")
    raise JaxportError(f"unknown dataset {dataset!r}: use shakespeare_char, shakespeare, openwebtext or text")


# -- reading -------------------------------------------------------------------------------------


def load_meta(path: str | os.PathLike) -> dict | None:
    path = Path(path)
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            meta = pickle.load(f)
        meta["vocab_size"]
    except Exception as err:  # unpickling errors come in many types
        raise JaxportError(f"{path} is not a nanoGPT meta.pkl ({type(err).__name__}: {err})") from None
    return meta


class Batches:
    """train.py's get_batch: `batch_size` random windows of `block_size + 1` ids per call.

    Each draw has its own generator, keyed by (seed, purpose, split, draw number): a batch depends only on
    where the run is, never on what was drawn before, so the sampler's whole state is the iteration
    number and a resumed run draws exactly the batches of an uninterrupted one."""

    PURPOSES = ("train", "eval")

    def __init__(self, data_dir: str | os.PathLike, block_size: int, batch_size: int, seed: int = 1337):
        self.data_dir = Path(data_dir)
        for split in ("train", "val"):
            path = self.data_dir / f"{split}.bin"
            if not path.exists():
                raise JaxportError(
                    f"data folder {self.data_dir} has no {split}.bin; create it with "
                    f"`jaxport gpt prepare shakespeare_char` (or shakespeare, text) "
                    f"or point --dataset/--data_dir at a prepared folder"
                )
            size = path.stat().st_size
            if size % 2:
                raise JaxportError(
                    f"{path} has {size} bytes, not a whole number of 2-byte (uint16) ids: it is "
                    f"truncated or not a nanoGPT .bin file; prepare it again"
                )
            n = size // 2
            if n <= block_size:
                raise JaxportError(f"{path} holds {n} ids, fewer than block_size + 1 = {block_size + 1}")
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed

    def get(
        self, split: str, shape: tuple[int, ...] = (), draw: int = 0, purpose: str = "train"
    ) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) int32 of shape (*shape, batch_size, block_size); y is x shifted by one id."""
        rng = np.random.default_rng([self.seed, self.PURPOSES.index(purpose), ("train", "val").index(split), draw])
        path = self.data_dir / f"{split}.bin"
        ix = rng.integers(0, path.stat().st_size // 2 - self.block_size, size=(*shape, self.batch_size))
        # One read per window, so the windows' pages do not pile up in memory (nanoGPT makes a fresh memmap per
        # batch for that; mapping and unmapping the file each call took more of the host's time between steps:
        # docs/performance.md, "Host work around the README run's steps").
        width = 2 * (self.block_size + 1)
        with open(path, "rb", buffering=0) as f:
            raw = b"".join(os.pread(f.fileno(), width, 2 * int(i)) for i in ix.flat)
        windows = np.frombuffer(raw, np.uint16).reshape(*ix.shape, self.block_size + 1).astype(np.int32)
        return windows[..., :-1], windows[..., 1:]
