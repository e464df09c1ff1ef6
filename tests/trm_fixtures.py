"""Loading the recorded TRM cases (tests/fixtures/trm/<case>) and their tolerances."""

import json
import os
from functools import cache
from pathlib import Path

import jax
import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "trm"
MODEL_CASES = ("att_rope_f32", "mlp_t_f32", "att_learned_bf16")
FLOAT_ARRAYS = ("logits", "q_halt_logits", "q_continue_logits", "z_H", "z_L")
BATCH_KEYS = ("inputs", "labels", "puzzle_identifiers")
# Set by test_trm_sharded.py: rerun the parity tests with batches sharded over this many devices.
NUM_DEVICES = int(os.environ.get("JAXPORT_TEST_SHARD_DEVICES", "0"))


@cache
def case(name: str) -> dict:
    return json.loads((FIXTURES / name / "case.json").read_text())


@cache
def arrays(name: str):
    d = FIXTURES / name
    return dict(np.load(d / "inputs.npz")), dict(np.load(d / "expected.npz"))


def batch(name: str, prefix: str) -> dict:
    inputs, _ = arrays(name)
    b = {k: inputs[f"{prefix}/{k}"] for k in BATCH_KEYS}
    if NUM_DEVICES:
        from jaxport.distributed import make_mesh, shard_batch

        assert len(jax.devices()) == NUM_DEVICES
        b = shard_batch(b, make_mesh(data=NUM_DEVICES))
    return b


def per_group(name: str) -> dict:
    return case(name)["tolerances"]["per_group"]


def array_tol(name: str, mode: str) -> dict:
    key = (
        "train/c*/{logits,q_halt_logits,q_continue_logits,z_H,z_L}"
        if mode == "train"
        else "eval/s*/{logits,q_halt_logits,q_continue_logits,z_H,z_L}"
    )
    return per_group(name)[key]


def loss_tol(name: str) -> dict:
    return per_group(name)["*/loss, */metrics/lm_loss, */metrics/q_halt_loss, */train_batch/*loss, eval/evaluate/*loss"]


def accuracy_tol(name: str) -> dict:
    return per_group(name)["*/metrics/accuracy, */train_batch/accuracy, eval/evaluate/accuracy"]


def close(actual, expected, tol: dict, what: str):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64),
        np.asarray(expected, np.float64),
        atol=tol["atol"],
        rtol=tol["rtol"],
        err_msg=what,
    )


def metric_tol(name: str, metric: str) -> dict | None:
    """None means exact (integer counts)."""
    if metric.endswith("loss"):
        return loss_tol(name)
    if metric == "accuracy":
        return accuracy_tol(name)
    return None


def check_call(name: str, prefix: str, carry, loss, metrics, outputs, all_finish, mode: str):
    """Compare one ACT call against `expected[prefix/...]` with the case's tolerances."""
    _, exp = arrays(name)
    tol = array_tol(name, mode)
    for key in ("logits", "q_halt_logits", "q_continue_logits"):
        close(np.asarray(outputs[key], np.float32), exp[f"{prefix}/{key}"], tol, f"{prefix}/{key}")
    close(np.asarray(carry.inner_carry.z_H, np.float32), exp[f"{prefix}/z_H"], tol, f"{prefix}/z_H")
    close(np.asarray(carry.inner_carry.z_L, np.float32), exp[f"{prefix}/z_L"], tol, f"{prefix}/z_L")
    np.testing.assert_array_equal(np.asarray(carry.halted), exp[f"{prefix}/halted"], f"{prefix}/halted")
    np.testing.assert_array_equal(np.asarray(carry.steps), exp[f"{prefix}/steps"], f"{prefix}/steps")
    for key in BATCH_KEYS:
        np.testing.assert_array_equal(
            np.asarray(carry.current_data[key]), exp[f"{prefix}/current_{key}"], f"{prefix}/current_{key}"
        )
    robust = exp[f"{prefix}/pred_gap"] >= case(name)["robustness"]["labels_ignored_where_top2_gap_below"]
    np.testing.assert_array_equal(
        np.asarray(outputs["preds"])[robust], exp[f"{prefix}/preds"][robust], f"{prefix}/preds"
    )
    close(loss, exp[f"{prefix}/loss"], loss_tol(name), f"{prefix}/loss")
    for metric, value in metrics.items():
        expected = exp[f"{prefix}/metrics/{metric}"]
        tol = metric_tol(name, metric)
        if tol is None:
            assert int(value) == int(expected), f"{prefix}/metrics/{metric}: {int(value)} != {int(expected)}"
        else:
            close(value, expected, tol, f"{prefix}/metrics/{metric}")
    assert bool(all_finish) == bool(exp[f"{prefix}/all_finish"])
