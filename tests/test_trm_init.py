"""TRM initialisation against upstream's init rules (models/common.py trunc_normal_init_, layers.py,
recursive_reasoning/trm.py) and the statistics recorded from upstream's freshly built models
(`init_stats_before_perturbation` in each fixture's case.json).

Upstream's rules: every CastedLinear weight is a truncated normal with std 1/sqrt(fan_in), embeddings
(tokens, learned positions) std 1/sqrt(hidden), H_init/L_init std 1 in the forward dtype; "truncated
normal" is JAX's: the std *after* truncation is the given one, the cut is at +-2 of the untruncated
normal's std (2.27 std). Zero-initialised: the puzzle-embedding table and q_head's weight; q_head's
bias is -5. Linear layers have no bias apart from q_head's.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trm_fixtures import MODEL_CASES, case

from jaxport import trm
from jaxport.trm.params import COMPILED_PREFIX

pytestmark = pytest.mark.slow

CONSTANT = {"model.inner.q_head.weight": 0.0, "model.inner.q_head.bias": -5.0, "model.inner.puzzle_emb.weights": 0.0}
STANDARD_ERRORS = 5  # how far a sample mean/std may stray from the rule's value
UNIT_TRUNCATED_STD = 0.8796256610342398  # std of a unit normal cut at +-2 (scipy.stats.truncnorm(-2, 2).std())


def upstream_std(key: str, shape: list[int], hidden: int) -> float:
    """The std upstream's code gives the tensor named `key` (without `_orig_mod.`)."""
    if key.endswith(("H_init", "L_init")):
        return 1.0
    if key.endswith("embedding_weight"):  # CastedEmbedding(init_std=1/sqrt(hidden))
        return 1.0 / math.sqrt(hidden)
    return 1.0 / math.sqrt(shape[1])  # CastedLinear: LeCun, fan_in = in_features of [out, in]


def truncated_normal_checks(stats: dict, std: float, dtype) -> list[str]:
    """What is wrong with `stats` (mean, std, min, max, shape) for a truncated normal of `std`."""
    n = math.prod(stats["shape"])
    bound = 2.0 * std / UNIT_TRUNCATED_STD  # upstream clips at +-2 * comp_std
    bound *= 1 + float(jnp.finfo(dtype).eps)  # the bound rounded to the tensor's dtype
    # a truncated normal cut at 2 sigma has kurtosis 2.63: the sample std's standard error is 0.64 std/sqrt(n)
    problems = []
    if abs(stats["mean"]) > STANDARD_ERRORS * std / math.sqrt(n):
        problems.append(f"mean {stats['mean']:.4g} is not 0")
    if abs(stats["std"] - std) > STANDARD_ERRORS * 0.64 * std / math.sqrt(n):
        problems.append(f"std {stats['std']:.4g} is not {std:.4g}")
    if max(-stats["min"], stats["max"]) > bound:
        problems.append(f"values reach {max(-stats['min'], stats['max']):.4g}, beyond the cut at {bound:.4g}")
    if n >= 4096 and max(-stats["min"], stats["max"]) < 0.97 * bound:  # big tensors reach the cut
        problems.append(f"values stay within {max(-stats['min'], stats['max']):.4g}, far inside the cut at {bound:.4g}")
    return problems


def statistics(array: np.ndarray) -> dict:
    x = np.asarray(array, np.float64)
    return {"shape": list(array.shape), "mean": x.mean(), "std": x.std(), "min": x.min(), "max": x.max()}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", MODEL_CASES)
def test_initial_weights_follow_upstreams_rules(name, seed):
    model_cfg = {k: v for k, v in case(name)["model_cfg"].items() if k != "causal"}
    recorded = case(name)["init_stats_before_perturbation"]
    model = trm.TRM(trm.TRMConfig(**model_cfg), rngs=nnx.Rngs(seed))
    weights = {k.removeprefix(COMPILED_PREFIX): v for k, v in trm.state_dict(model).items()}
    assert list(weights) == list(recorded)  # the same tensors as upstream's fresh model, in its order
    for key, upstream in recorded.items():
        ours = statistics(weights[key])
        assert ours["shape"] == upstream["shape"] and weights[key].dtype.name == upstream["dtype"], key
        if key in CONSTANT:
            np.testing.assert_array_equal(weights[key], CONSTANT[key], err_msg=key)
            assert upstream["min"] == upstream["max"] == CONSTANT[key], key
            continue
        std = upstream_std(key, upstream["shape"], model_cfg["hidden_size"])
        assert truncated_normal_checks(upstream, std, weights[key].dtype) == [], f"the rule misreads upstream: {key}"
        assert truncated_normal_checks(ours, std, weights[key].dtype) == [], key
