"""Does a Dream directory written by jaxport load in the ORIGINAL Hugging Face code with the same logits?

Run with the originals' Python (torch + transformers 4.46.2, see ../shared/originals/setup):

    eval "$(../shared/originals/setup)"
    $REF_PY tools/dream_export_check.py [--model DIR ...] [--jaxport-python .venv/bin/python]

Default models: two `jaxport dream export`s of tests/fixtures/dream/task_model (a trained model): float32
in one file, and bfloat16 in 200 kB shards with model.safetensors.index.json. Each is copied to a
temporary folder with the original's model code (configuration_dream.py, modeling_dream.py,
generation_utils.py from $REF_DREAM) beside the weights, as published checkpoints ship it, and loaded
with `AutoModel.from_pretrained(dir, trust_remote_code=True)` in float32. Its logits for token rows
(unpadded, and left-padded with the 4-D mask and position ids upstream's sampler derives) are compared
with the logits jaxport computes (with the project's Python) from the folder that was exported, its weights
rounded to the export's dtype (for `--model DIR`: from DIR itself), within the float32 logits tolerance
of the fixtures (tests/fixtures/dream/tiny_sharded/case.json). Prints JSON; exits 1 if any model differs.
`tests/test_dream_export_original.py` runs it in the suite.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CODE_FILES = ("configuration_dream.py", "modeling_dream.py", "generation_utils.py")
TASK_MODEL = ROOT / "tests" / "fixtures" / "dream" / "task_model"
TOLERANCE = json.loads((ROOT / "tests" / "fixtures" / "dream" / "tiny_sharded" / "case.json").read_text())["tolerances"]
ATOL, RTOL = TOLERANCE["logits"]["atol"], TOLERANCE["logits"]["rtol"]

# jaxport's logits of the model that was exported (its weights rounded to the export's dtype, computed in float32 as
# the original side computes), read from the source folder, so that an export that writes wrong weights is caught
JAXPORT_SIDE = """
import sys, jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxport.dream import DreamConfig, load_model
source, rounded_to = sys.argv[4], jnp.dtype(sys.argv[5])
graphdef, state = nnx.split(load_model(source, DreamConfig.from_model_dir(source), dtype="float32"))
model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(rounded_to).astype(jnp.float32), state))
rows = np.load(sys.argv[2])
np.savez(sys.argv[3], plain=np.asarray(model(rows["plain"]), np.float32),
         padded=np.asarray(model(rows["padded"], rows["padded_mask"]), np.float32))
"""


def token_rows(config: dict, seed: int = 0) -> dict:
    """Three unpadded rows of random tokens (one mostly masks) and two left-padded ones."""
    rng = np.random.default_rng(seed)
    low = min(config["mask_token_id"], config["eos_token_id"])
    plain = rng.integers(0, low, (3, 40))
    plain[1, 10:] = config["mask_token_id"]
    padded = rng.integers(0, low, (2, 24))
    mask = np.ones_like(padded)
    mask[0, :7] = 0
    padded[0, :7] = config["pad_token_id"]
    return {"plain": plain.astype(np.int32), "padded": padded.astype(np.int32), "padded_mask": mask.astype(np.int32)}


def original_logits(model_dir: Path, rows: dict) -> dict:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), trust_remote_code=True, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        plain = model(torch.from_numpy(rows["plain"]).long()).logits.numpy()
        # as upstream's sampler derives them: pad rows see nothing, positions count real tokens
        valid = torch.from_numpy(rows["padded_mask"]).bool()
        mask_4d = valid[:, None, None, :] & valid[:, None, :, None]
        positions = valid.long().cumsum(-1) - 1
        positions.masked_fill_(~valid, 1)
        padded = model(torch.from_numpy(rows["padded"]).long(), mask_4d, positions).logits.numpy()
    return {"plain": plain, "padded": padded}


def check(model_dir: Path, jaxport_python: str, work: Path, source: Path | None = None) -> dict:
    """The original's logits of the exported `model_dir` against jaxport's of `source` (the folder exported; default
    `model_dir` itself) with its weights rounded to the export's dtype."""
    runnable = work / model_dir.name
    shutil.copytree(model_dir, runnable)
    for name in CODE_FILES:
        shutil.copy(Path(os.environ["REF_DREAM"]) / name, runnable / name)
    config = json.loads((runnable / "config.json").read_text())
    rows = token_rows(config)
    np.savez(work / "rows.npz", **rows)
    done = subprocess.run(
        [jaxport_python, "-c", JAXPORT_SIDE, str(model_dir), str(work / "rows.npz"), str(work / "jaxport.npz")]
        + [str(source or model_dir), config["torch_dtype"]],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"jaxport failed on {model_dir}:\n{done.stderr[-3000:]}")
    ours = np.load(work / "jaxport.npz")
    theirs = original_logits(runnable, rows)
    valid = rows["padded_mask"].astype(bool)
    report = {
        "model": str(model_dir),
        "torch_dtype": config["torch_dtype"],
        "files": sorted(p.name for p in model_dir.glob("model*.safetensors*")),
    }
    ok = True
    for name, where in (("plain", np.ones(rows["plain"].shape, bool)), ("padded", valid)):
        a, b = ours[name][where], theirs[name][where]
        close = bool(np.allclose(a, b, atol=ATOL, rtol=RTOL))
        ok &= close
        report[name] = {
            "max_abs_diff": float(np.max(np.abs(a - b))),
            "max_abs_logit": float(np.max(np.abs(b))),
            "argmax_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
            "within_tolerance": close,
        }
    report["ok"] = ok
    return report


def export(jaxport_python: str, source: Path, output: Path, dtype: str, max_shard_size: str) -> Path:
    """`jaxport dream export SOURCE --output OUTPUT --dtype DTYPE --max-shard-size SIZE`."""
    argv = [jaxport_python, "-m", "jaxport.cli", "dream", "export", str(source), "--output", str(output)]
    done = subprocess.run(argv + ["--dtype", dtype, "--max-shard-size", max_shard_size], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"jaxport dream export failed:\n{done.stderr[-3000:]}")
    return output


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="*", default=None, help="exported Dream directories to check")
    parser.add_argument("--jaxport-python", default=str(ROOT / ".venv" / "bin" / "python"))
    args = parser.parse_args()
    if "REF_DREAM" not in os.environ:
        raise SystemExit('set REF_DREAM (eval "$(../shared/originals/setup)")')
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = [(Path(m), None) for m in args.model] if args.model else None
        if models is None:
            models = [
                (export(args.jaxport_python, TASK_MODEL, work / "task_model_float32", "float32", "5GB"), TASK_MODEL),
                (
                    export(args.jaxport_python, TASK_MODEL, work / "task_model_bfloat16_sharded", "bfloat16", "200KB"),
                    TASK_MODEL,
                ),
            ]
        reports = []
        for i, (model_dir, source) in enumerate(models):
            case = work / f"case{i}"
            case.mkdir()
            reports.append(check(model_dir, args.jaxport_python, case, source))
    versions = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": sys.version.split()[0],
    }
    print(
        json.dumps(
            {
                "what": "jaxport export -> original AutoModel.from_pretrained(trust_remote_code=True)",
                "tolerance": {"atol": ATOL, "rtol": RTOL},
                "versions": versions,
                "results": reports,
            },
            indent=1,
        )
    )
    sys.exit(0 if all(r["ok"] for r in reports) else 1)


if __name__ == "__main__":
    main()
