"""Tensor-parallel + FSDP sharding over 8 fake CPU devices gives the same tokens as one device: every recorded
generation setting, and the tie rule on saturated confidences."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CASE = Path(__file__).parent / "fixtures" / "dream" / "tiny_sharded"

SCRIPT = r"""
import json, sys
import jax, numpy as np
from jaxport import dream
from jaxport.distributed import make_mesh

case = sys.argv[1]
assert jax.device_count() == 8
mesh = make_mesh(data=1, fsdp=2, model=4)
model, _ = dream.load(case + "/model", mesh=mesh)
inputs, expected = np.load(case + "/inputs.npz"), np.load(case + "/expected.npz")
q = model.layers[0].self_attn.q_proj.weight[...]
report = {"q_spec": list(q.sharding.spec), "q_shard_shape": list(q.addressable_shards[0].data.shape),
          "lm_head_spec": list(model.lm_head.weight[...].sharding.spec)}
valid = expected["valid_positions"]
logits = np.asarray(model(expected["sampler_input_ids"], valid.astype(np.int32)))
report["logits_max_diff"] = float(np.abs(logits - expected["logits"])[valid].max())
settings = json.loads(open(case + "/case.json").read())["generation"]
tol = json.loads(open(case + "/case.json").read())["tolerances"]["confidence"]
for name, s in settings.items():
    out = model.diffusion_generate(inputs["input_ids"], inputs["attention_mask"], max_new_tokens=s["max_new_tokens"],
                                   steps=s["steps"], alg=s["alg"], temperature=s["temperature"], top_p=s["top_p"],
                                   top_k=s["top_k"], eps=s["eps"], output_history=True, output_scores=True)
    same = [np.array_equal(np.asarray(getattr(out, k)), expected[f"gen__{name}__{k}"])
            for k in ("sequences", "history", "n_transfer", "x0")]
    conf, want = np.asarray(out.confidence), expected[f"gen__{name}__confidence"]
    finite = np.isfinite(want)
    same.append(np.array_equal(np.isfinite(conf), finite)
                and np.allclose(conf[finite], want[finite], atol=tol["atol"], rtol=tol["rtol"]))
    report[name] = bool(all(same))
# Saturated confidences (top_k=1): ties unmask the leftmost masks first, exactly and block-wise.
L = inputs["input_ids"].shape[1]
for name, fast in [("ties_exact", {}), ("ties_dual", dict(block_length=4, cache="dual"))]:
    out = model.diffusion_generate(inputs["input_ids"], inputs["attention_mask"], max_new_tokens=16, steps=8,
                                   alg="entropy", top_k=1, output_history=True, output_scores=True, **fast)
    filled = np.asarray(out.history)[:, :, L:] != model.config.mask_token_id
    counts = np.cumsum(np.asarray(out.n_transfer), axis=0)
    report[name] = bool((filled == (np.arange(16) < counts[..., None])).all())
print(json.dumps(report))
"""


def test_eight_devices_same_tokens():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(CASE)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["q_spec"] == ["model", "fsdp"] and report["q_shard_shape"] == [16, 32]
    assert report["lm_head_spec"] == ["model", "fsdp"]
    tol = json.loads((CASE / "case.json").read_text())["tolerances"]["logits"]
    assert report["logits_max_diff"] <= tol["atol"]
    settings = json.loads((CASE / "case.json").read_text())["generation"]
    assert len(settings) == 12 and {name: report[name] for name in settings} == {name: True for name in settings}
    assert report["ties_exact"] and report["ties_dual"]
