"""Record nanoGPT's bfloat16 and float16 training iterations as fixtures beside nanogpt_train_resume.

Run with the originals' Python (torch, and nanoGPT at $REF_NANOGPT; see ../shared/originals/setup):

    eval "$(../shared/originals/setup)"
    $REF_PY tools/record_gpt_reduced_precision.py [--out tests/fixtures/gpt]

It writes `nanogpt_train_resume_bfloat16/` and `nanogpt_train_resume_float16/` (case.json, expected.npz)
and uses the float32 case's `ckpt.pt` and `inputs.npz` as they are (named in case.json with their sha256).

nanoGPT's train.py autocasts only on a GPU (`ctx = nullcontext() if device_type == 'cpu' else
torch.amp.autocast(...)`, and its GradScaler is `torch.cuda.amp`'s), so on a CPU its `--dtype` computes in
float32. This script runs train.py's resumed iterations as train.py runs them on a GPU, with the device
moved to the CPU: nanoGPT's model.py unmodified, its `configure_optimizers`, the checkpoint's AdamW
state, and per iteration the learning rate of the float32 case, `with torch.autocast("cpu", dtype)` for
the forward of each micro-batch, `scaler.scale(loss).backward()`, `scaler.unscale_`, `clip_grad_norm_`,
`scaler.step`, `scaler.update` (`torch.amp.GradScaler("cpu")` with torch's defaults, enabled for float16
as train.py's). It first replays the iterations in float32 and stops unless that reproduces the float32
case's recorded numbers (the same procedure, then), and checks that CPU autocast gives nanoGPT's ops the
dtypes CUDA's autocast gives them (linear in the low precision, the loss in float32, LayerNorm on the
float32 residual stream).

Tolerances: two low-precision computations of the same iteration that are each as far from float32 as
the original's differ by at most twice that distance, so each quantity's tolerance is twice the gap this
run measures between the original's low-precision and float32 results, rounded up to two significant
digits: the largest relative gap of the losses and of the gradient norms (rtol), and the root mean square
of the weights' gap after the two iterations (`rms`: the weights' largest gaps are where a gradient near
zero turns an AdamW step's sign, bounded by the step size whatever the precision).
"""

import argparse
import hashlib
import json
import math
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
BASE = "nanogpt_train_resume"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def round_up(x: float, digits: int = 2) -> float:
    """`x` rounded up to `digits` significant digits."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - digits + 1)
    return float(f"{math.ceil(x / scale - 1e-9) * scale:.{digits}g}")


def autocast_dtypes(dtype) -> dict:
    """The dtypes nanoGPT's ops produce under CPU autocast (CUDA's lists give: linear low, loss float32)."""
    x = torch.randn(2, 3, 8)
    w = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=dtype):
        linear = torch.nn.functional.linear(x, w)
        q = linear.view(2, 3, 2, 4).transpose(1, 2)
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        residual = x + linear
        norm = torch.nn.functional.layer_norm(residual, (8,))
        loss = torch.nn.functional.cross_entropy(linear.view(-1, 8), torch.zeros(6, dtype=torch.long))
    return {
        "linear": str(linear.dtype),
        "scaled_dot_product_attention": str(attention.dtype),
        "residual_add": str(residual.dtype),
        "layer_norm_of_residual": str(norm.dtype),
        "cross_entropy": str(loss.dtype),
    }


def run_iterations(model_module, ckpt: dict, case: dict, inputs, expected, dtype_name: str) -> dict:
    """train.py's loop body for the recorded iterations; returns what it produced."""
    cfg = case["train_config"]
    model = model_module.GPT(model_module.GPTConfig(**ckpt["model_args"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    model.load_state_dict(state)
    model.train()
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (0.9, cfg["beta2"]), "cpu")
    optimizer.load_state_dict(ckpt["optimizer"])
    low = DTYPES.get(dtype_name)
    ctx = nullcontext() if low is None else torch.autocast("cpu", dtype=low)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype_name == "float16")
    accum = cfg["gradient_accumulation_steps"]
    micro_losses, norms, scales = [], [], []
    for it, lr in enumerate(expected["lr_iter"]):
        for group in optimizer.param_groups:
            group["lr"] = float(lr)
        losses = []
        for m in range(accum):
            X = torch.from_numpy(inputs["train_x"][it, m])
            Y = torch.from_numpy(inputs["train_y"][it, m])
            with ctx:
                _, loss = model(X, Y)
                losses.append(loss.item())
                loss = loss / accum
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        micro_losses.append(losses)
        scales.append(float(scaler.get_scale()) if scaler.is_enabled() else 1.0)
    out = {
        "micro_loss": np.asarray(micro_losses, np.float32),
        "grad_norm": np.asarray(norms, np.float32),
        "loss_scale": np.asarray(scales, np.float32),
    }
    for name, value in model.state_dict().items():
        out[f"model/{name}"] = value.detach().numpy().astype(np.float32)
    return out


def check_float32_replay(replay: dict, expected, tolerances: dict):
    """The float32 replay must give the float32 case's numbers within its tolerances."""
    np.testing.assert_allclose(replay["micro_loss"], expected["micro_loss"], **tolerances["micro_loss"])
    np.testing.assert_allclose(replay["grad_norm"], expected["grad_norm"], **tolerances["grad_norm"])
    for key in expected.files:
        if key.startswith("model/"):
            np.testing.assert_allclose(replay[key], expected[key], err_msg=key, **tolerances["model/*"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "gpt"))
    args = parser.parse_args()
    ref = os.environ.get("REF_NANOGPT")
    if not ref or not (Path(ref) / "model.py").is_file():
        raise SystemExit('set REF_NANOGPT to nanoGPT\'s folder (eval "$(../shared/originals/setup)")')
    sys.path.insert(0, ref)
    import model as model_module  # nanoGPT's model.py

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one reduction order per run
    base = Path(args.out) / BASE
    case = json.loads((base / "case.json").read_text())
    ckpt = torch.load(base / "ckpt.pt", map_location="cpu", weights_only=False)
    inputs, expected = np.load(base / "inputs.npz"), np.load(base / "expected.npz")
    replay = run_iterations(model_module, ckpt, case, inputs, expected, "float32")
    check_float32_replay(replay, expected, case["tolerances"])
    for dtype_name, dtype in DTYPES.items():
        low = run_iterations(model_module, ckpt, case, inputs, expected, dtype_name)
        loss_gap = float(np.max(np.abs(low["micro_loss"] / replay["micro_loss"] - 1)))
        norm_gap = float(np.max(np.abs(low["grad_norm"] / replay["grad_norm"] - 1)))
        weights = [k for k in low if k.startswith("model/")]
        weight_gap = max(float(np.max(np.abs(low[k] - replay[k]))) for k in weights)
        weight_rms_gap = float(np.sqrt(np.mean(np.concatenate([np.ravel(low[k] - replay[k]) ** 2 for k in weights]))))
        tolerances = {
            "micro_loss": {"atol": 0.0, "rtol": round_up(2 * loss_gap)},
            "grad_norm": {"atol": 0.0, "rtol": round_up(2 * norm_gap)},
            "model/*": {"rms": round_up(2 * weight_rms_gap)},
            "loss_scale": "exact",
        }
        out = Path(args.out) / f"{BASE}_{dtype_name}"
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / "expected.npz", **low)
        meta = {
            "family": "gpt",
            "case": out.name,
            "description": (
                f"nanoGPT's two resumed iterations of {BASE} (iterations 300, 301, gradient_accumulation_steps=2, "
                f"grad_clip=0.5) computed as train.py computes them with --dtype={dtype_name} on a GPU: autocast to "
                f"{dtype_name} around each forward"
                + (", GradScaler (init scale 2**16)" if dtype_name == "float16" else ", no GradScaler")
                + ", with the device moved to the CPU"
            ),
            "upstream": case["upstream"],
            "dtype": dtype_name,
            "device": "cpu (torch.autocast('cpu'))",
            "uses": {f"../{BASE}/{name}": sha256(base / name) for name in ("ckpt.pt", "inputs.npz", "expected.npz")},
            "equivalent_train_command": case["train_command"]
            .replace("--device=cpu", "--device=cuda")
            .replace("--dtype=float32", f"--dtype={dtype_name}"),
            "procedure": [
                f"{BASE}'s procedure, with its learning rates (expected.npz lr_iter of {BASE})",
                f"each micro-batch's forward and loss under torch.autocast('cpu', dtype=torch.{dtype_name}), "
                "as train.py's ctx on a GPU",
                "scaler.scale(loss / gradient_accumulation_steps).backward(); scaler.unscale_(optimizer); "
                "clip_grad_norm_; scaler.step(optimizer); scaler.update(); zero_grad(set_to_none=True)",
                "torch.set_num_threads(1)",
            ],
            "autocast_dtypes": autocast_dtypes(dtype),
            "float32_replay": "the same script without autocast reproduced the float32 case within its tolerances",
            "gap_to_float32": {
                "micro_loss_max_rel": loss_gap,
                "grad_norm_max_rel": norm_gap,
                "model_rms": weight_rms_gap,
                "model_max_abs": weight_gap,
            },
            "tolerances": tolerances,
            "tolerance_rationale": (
                "twice the gap between the original's own low-precision and float32 results of these iterations "
                "(gap_to_float32: the largest relative gap of the losses and of the gradient norms, the root mean "
                "square over the weights), rounded up to two significant digits: a port whose low-precision "
                "iteration is no farther from float32 than the original's stays within it"
            ),
            "expected": {
                "micro_loss": "(2,2) float32 loss of each micro step (before / gradient_accumulation_steps)",
                "grad_norm": "(2,) float32 clip_grad_norm_ total norm after unscale_, before clipping",
                "loss_scale": "(2,) float32 GradScaler scale after each iteration's update (1.0: disabled)",
                "model/*": "float32 master weights after the two iterations (compared all together: the root mean "
                "square of the difference over every weight)",
            },
            "generator": {
                "script": "tools/record_gpt_reduced_precision.py",
                "command": '$REF_PY tools/record_gpt_reduced_precision.py (after eval "$(../shared/originals/setup)")',
                "library_versions": {
                    "python": sys.version.split()[0],
                    "torch": torch.__version__,
                    "numpy": np.__version__,
                },
            },
        }
        (out / "case.json").write_text(json.dumps(meta, indent=2) + "\n")
        print(json.dumps({"case": out.name, "gap_to_float32": meta["gap_to_float32"], "tolerances": tolerances}))


if __name__ == "__main__":
    main()
