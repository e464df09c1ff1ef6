"""Tensor-parallel + FSDP sharding over 8 fake CPU devices gives the same tokens as one device."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
for name, kwargs in [("entropy_s8", dict(alg="entropy", steps=8)),
                     ("maskgit_plus_s8_topk5", dict(alg="maskgit_plus", steps=8, top_k=5))]:
    out = model.diffusion_generate(inputs["input_ids"], inputs["attention_mask"], max_new_tokens=16,
                                   output_history=True, **kwargs)
    report[name] = (bool(np.array_equal(np.asarray(out.sequences), expected[f"gen__{name}__sequences"]))
                    and bool(np.array_equal(np.asarray(out.history), expected[f"gen__{name}__history"])))
print(json.dumps(report))
"""


def test_eight_devices_same_tokens():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(CASE)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["q_spec"] == ["model", "fsdp"] and report["q_shard_shape"] == [16, 32]
    assert report["lm_head_spec"] == ["model", "fsdp"]
    tol = json.loads((CASE / "case.json").read_text())["tolerances"]["logits"]
    assert report["logits_max_diff"] <= tol["atol"]
    assert report["entropy_s8"] and report["maskgit_plus_s8_topk5"]
