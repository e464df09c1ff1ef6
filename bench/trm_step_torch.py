"""Same-machine PyTorch baseline for bench/trm_step.py: one TRM ACT call forward + backward at the
paper's Sudoku architecture, eager, written with the upstream model's operations (post-norm blocks,
weightless float32 RMSNorm, fused qkv and gate_up projections, SDPA, rotate-half RoPE, H_cycles - 1
cycles under no_grad, stablemax loss in float64). It is not the upstream code, which is not
vendored here; it exists so the JAX figures can be read against torch on the same CPU.

    python bench/trm_step_torch.py [--threads 2] [--steps 3]
"""

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

B, SEQ, PUZ, D, HEADS, VOCAB = 32, 81, 16, 512, 8, 11
H_CYCLES, L_CYCLES, L_LAYERS, INTER = 3, 6, 2, 1536


def rms(x):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), -1)


class Block(torch.nn.Module):
    def __init__(self, mlp_t: bool):
        super().__init__()
        self.mlp_t = mlp_t
        S = SEQ + PUZ
        if mlp_t:
            self.t_gate_up = torch.nn.Linear(S, 2 * 256 * math.ceil(round(4 * S * 2 / 3) / 256), bias=False)
            self.t_down = torch.nn.Linear(self.t_gate_up.out_features // 2, S, bias=False)
        else:
            self.qkv = torch.nn.Linear(D, 3 * D, bias=False)
            self.o = torch.nn.Linear(D, D, bias=False)
        self.gate_up = torch.nn.Linear(D, 2 * INTER, bias=False)
        self.down = torch.nn.Linear(INTER, D, bias=False)

    def swiglu(self, x, gate_up, down):
        g, u = gate_up(x).chunk(2, -1)
        return down(F.silu(g) * u)

    def forward(self, h, cos, sin):
        if self.mlp_t:
            t = h.transpose(1, 2)
            h = rms(t + self.swiglu(t, self.t_gate_up, self.t_down)).transpose(1, 2)
        else:
            q, k, v = self.qkv(h).view(B, -1, 3 * HEADS, D // HEADS).split(HEADS, 2)
            q, k = [(t.float() * cos[:, None] + rotate_half(t.float()) * sin[:, None]).to(h.dtype) for t in (q, k)]
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            h = rms(h + self.o(a.transpose(1, 2).reshape(B, -1, D)))
        return rms(h + self.swiglu(h, self.gate_up, self.down))


class TRMStep(torch.nn.Module):
    def __init__(self, mlp_t: bool, dtype):
        super().__init__()
        self.dtype = dtype
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleList(Block(mlp_t) for _ in range(L_LAYERS))
        self.lm_head = torch.nn.Linear(D, VOCAB, bias=False)
        self.q_head = torch.nn.Linear(D, 2)
        inv = 1.0 / (10000 ** (torch.arange(0, D // HEADS, 2).float() / (D // HEADS)))
        emb = torch.outer(torch.arange(SEQ + PUZ).float(), inv).repeat(1, 2)
        self.cos, self.sin = emb.cos(), emb.sin()

    def level(self, h, inj):
        h = h + inj
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        return h

    def forward(self, inputs, puzzle, labels):
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32):
            x = math.sqrt(D) * torch.cat([puzzle.view(B, PUZ, D), self.embed(inputs)], 1).to(self.dtype)
            z_H = torch.zeros(B, SEQ + PUZ, D, dtype=self.dtype)
            z_L = torch.zeros_like(z_H)
            with torch.no_grad():
                for _ in range(H_CYCLES - 1):
                    for _ in range(L_CYCLES):
                        z_L = self.level(z_L, z_H + x)
                    z_H = self.level(z_H, z_L)
            for _ in range(L_CYCLES):
                z_L = self.level(z_L, z_H + x)
            z_H = self.level(z_H, z_L)
            logits = self.lm_head(z_H)[:, PUZ:].double()
            q = self.q_head(z_H[:, 0]).float()
        s = torch.where(logits < 0, 1 / (1 - logits), logits + 1)
        lm = -torch.log(s / s.sum(-1, keepdim=True)).gather(-1, labels[..., None]).sum() / SEQ
        return lm + 0.5 * F.binary_cross_entropy_with_logits(q[:, 0], torch.ones(B), reduction="sum")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(json.dumps({"machine": {"torch": torch.__version__, "threads": args.threads, "cpu": platform.processor()}}))
    for mlp_t in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            model = TRMStep(mlp_t, dtype)
            inputs, labels = torch.randint(1, VOCAB, (B, SEQ)), torch.randint(2, VOCAB, (B, SEQ))
            puzzle = torch.zeros(B, PUZ * D, requires_grad=True)
            times = []
            for i in range(args.steps + 1):
                t0 = time.perf_counter()
                (model(inputs, puzzle, labels) / B).backward()
                if i:
                    times.append(time.perf_counter() - t0)
            print(json.dumps({"benchmark": "trm_act_call_fwd_bwd_torch_eager", "mixer": "mlp_t" if mlp_t else "attention",
                              "forward_dtype": str(dtype).removeprefix("torch."), "batch": B,
                              "step_s_median": round(statistics.median(times), 3),
                              "step_s_all": [round(t, 3) for t in times]}), flush=True)


if __name__ == "__main__":
    main()
