"""The PyTorch originals' workloads of `bench/suite.py`, run by the originals' Python (REF_PY) on the upstream
code unmodified (imported from REF_NANOGPT, REF_TRM, REF_DREAM), under `torch.compile` as upstream runs them.
Writes one JSON file: the device, torch/CUDA versions and one record per configuration, named as the suite's
rows (first call, median steady-state seconds, throughput, per-row memory high-water mark).

    $REF_PY bench/torch_originals.py gpt --spec SPEC.json --out OUT.json [--device cuda] [--no-compile]

SPEC.json holds what `bench/suite.py` measures on the jaxport side, so both run the same configuration:
  gpt    {"model": nanoGPT GPTConfig kwargs, "batch_size", "learning_rate", "beta2", "weight_decay", "iters", "warmup"}
         one train.py iteration: forward under bf16 autocast (float32 on a CPU, as train.py), backward,
         clip_grad_norm_(1.0), AdamW (fused on CUDA, model.configure_optimizers), zero_grad; TF32 allowed as train.py
  trm    {"configs": [{"name", "arch": upstream TinyRecursiveReasoningModel_ACTV1Config kwargs}], "loss_type",
         "steps", "warmup"}: one ACT call of ACTLossHead in training mode + backward of loss / batch, the carry
         kept across calls, built under `torch.device` and compiled as pretrain.py does
  dream  {"config": config.json dict, "dtype", "prompt_len", "new_tokens", "batches", "alg", "repeats"}: upstream's
         exact diffusion_generate (steps = new tokens, temperature 0) on AutoModel.from_config with random weights;
         the model's forward is what gets compiled (generation is a Python loop over it)
"""

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from compare import SHARED  # stdlib only: this Python has no jaxport


class Device:
    """Synchronisation and per-row memory high-water marks on CUDA or the CPU."""

    def __init__(self, name: str):
        self.name, self.cuda = name, name.startswith("cuda")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def memory(self) -> dict:
        if self.cuda:
            return {"memory_bytes": torch.cuda.max_memory_allocated(), "memory_source": "torch max_memory_allocated"}
        return {
            "memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "memory_source": "process peak RSS",
        }

    def describe(self) -> dict:
        kind = torch.cuda.get_device_name() if self.cuda else platform.processor() or platform.machine()
        return {
            "device": kind,
            "platform": "gpu" if self.cuda else "cpu",
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        }


def timed(device: Device, call, runs: int, warmup: int = 0) -> dict:
    """The first call (compilation included), `warmup` untimed calls, then the median of `runs` calls."""
    device.reset_peak()
    times = []
    for _ in range(1 + warmup + runs):
        start = time.perf_counter()
        call()
        device.sync()
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1 + warmup :])
    return {
        "first_s": times[0],
        "compile_s": times[0] - median,
        "step_s": median,
        "step_s_all": times[1 + warmup :],
        **device.memory(),
    }


def gpt(spec: dict, device: Device, compile: bool) -> list[dict]:
    sys.path.insert(0, os.environ["REF_NANOGPT"])
    from model import GPT, GPTConfig  # upstream nanoGPT model.py

    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True  # train.py's settings
    torch.backends.cudnn.allow_tf32 = True
    kind = "cuda" if device.cuda else "cpu"
    ctx = torch.amp.autocast(device_type=kind, dtype=torch.bfloat16) if device.cuda else contextlib.nullcontext()
    model = GPT(GPTConfig(**spec["model"])).to(device.name)
    optimizer = model.configure_optimizers(spec["weight_decay"], spec["learning_rate"], (0.9, spec["beta2"]), kind)
    forward = torch.compile(model) if compile else model
    rows, block = spec["batch_size"], spec["model"]["block_size"]
    X, Y = (torch.randint(spec["model"]["vocab_size"], (rows, block), device=device.name) for _ in range(2))

    def iteration():  # train.py's, gradient_accumulation_steps 1 (bf16 needs no GradScaler: train.py's is off)
        with ctx:
            _, loss = forward(X, Y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = timed(device, iteration, spec["iters"], spec["warmup"])
    return [
        {
            "name": "training iteration",
            "dtype": "bfloat16 autocast" if device.cuda else "float32",
            **result,
            "throughput": rows * block / result["step_s"],
            "num_params": model.get_num_params(),
            "mfu_a100_bf16": model.estimate_mfu(rows, result["step_s"]),
        }
    ]


def trm(spec: dict, device: Device, compile: bool) -> list[dict]:
    sys.path.insert(0, os.environ["REF_TRM"])
    from utils.functions import load_model_class  # upstream TinyRecursiveModels

    model_class = load_model_class("recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1")
    loss_class = load_model_class("losses@ACTLossHead")

    def measure(arch: dict) -> dict:
        torch.manual_seed(0)
        rows, length, vocab = arch["batch_size"], arch["seq_len"], arch["vocab_size"]
        with torch.device(device.name):  # as pretrain.py builds the model and the carry
            model = loss_class(model_class(arch), loss_type=spec["loss_type"])
            model.train()
            batch = {
                "inputs": torch.randint(1, vocab, (rows, length), dtype=torch.int32),
                "labels": torch.randint(1, vocab, (rows, length), dtype=torch.int32),
                "puzzle_identifiers": torch.zeros(rows, dtype=torch.int32),
            }
            carry = model.initial_carry(batch)
        forward = torch.compile(model) if compile else model
        # the parameters and the sparse puzzle embedding's per-batch rows (a buffer that takes gradients)
        leaves = [*model.parameters(), *(b for b in model.buffers() if b.requires_grad)]

        def step():
            nonlocal carry
            for leaf in leaves:
                leaf.grad = None
            carry, loss, *_ = forward(carry=carry, batch=batch, return_keys=[])
            ((1 / rows) * loss).backward()

        result = timed(device, step, spec["steps"], spec["warmup"])
        return {
            "dtype": arch["forward_dtype"],
            **result,
            "throughput": rows / result["step_s"],
            "n_params": sum(p.numel() for p in model.parameters()),
        }

    return [{"name": config["name"], **measure(config["arch"])} for config in spec["configs"]]


def dream(spec: dict, device: Device, compile: bool) -> list[dict]:
    sys.path.insert(0, str(SHARED / "originals" / "bench" / "dream"))
    import dreamref  # assembles a model folder from the upstream files in REF_DREAM (HF offline)
    from transformers import AutoConfig, AutoModel

    runnable = dreamref.RunnableDir(None, with_tokenizer_code=False)
    runnable.write_json("config.json", spec["config"])
    config = AutoConfig.from_pretrained(str(runnable.path), trust_remote_code=True)
    torch.manual_seed(0)
    with torch.device(device.name):  # random weights drawn on the device (7B in seconds, not minutes)
        model = AutoModel.from_config(config, trust_remote_code=True, torch_dtype=getattr(torch, spec["dtype"])).eval()
    if compile:  # generation calls the module, so its forward is the compiled function
        model.forward = torch.compile(model.forward, dynamic=False)  # a static graph per batch size
    cfg, new = spec["config"], spec["new_tokens"]
    low = min(cfg["mask_token_id"], cfg["eos_token_id"], cfg["vocab_size"])  # prompts below every special id

    def measure(batch: int) -> dict:
        ids = torch.randint(0, low, (batch, spec["prompt_len"]), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device.name)

        def generate():
            with torch.no_grad():
                model.diffusion_generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    steps=new,
                    temperature=0.0,
                    alg=spec["alg"],
                    alg_temp=0.0,
                )

        result = timed(device, generate, spec["repeats"])
        return {
            "name": f"exact, batch {batch}",
            "dtype": spec["dtype"],
            **result,
            "throughput": batch * new / result["step_s"],
        }

    rows = [measure(batch) for batch in spec["batches"]]
    runnable.cleanup()
    return rows


FAMILIES = {"gpt": gpt, "trm": trm, "dream": dream}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("--spec", required=True, help="JSON file: the workload (see above)")
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    device = Device(args.device)
    spec = json.loads(Path(args.spec).read_text())
    rows = FAMILIES[args.family](spec, device, args.compile)
    Path(args.out).write_text(json.dumps({**device.describe(), "compiled": args.compile, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
