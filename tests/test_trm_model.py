"""TRM parity with TinyRecursiveModels: training-mode ACT calls with carried state, eval halting,
losses, metrics, gradients, and checkpoint import/export, against recorded upstream numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trm_fixtures import (
    BATCH_KEYS,
    FIXTURES,
    MODEL_CASES,
    NUM_DEVICES,
    accuracy_tol,
    arrays,
    batch,
    case,
    check_call,
    close,
    loss_tol,
    per_group,
)

from jaxport import trm
from jaxport.errors import JaxportError
from jaxport.trm.evaluate import evaluate, reduce_train_metrics, run_to_halt
from jaxport.trm.model import loss_and_grad

pytestmark = pytest.mark.slow

# Each case as recorded, and the float32 cases again with the recursion run on two row chunks.
LOADED = [(name, None) for name in MODEL_CASES] + [(name, 2) for name in MODEL_CASES if name.endswith("f32")]


@pytest.fixture(scope="module", params=LOADED, ids=[f"{n}-chunks{c}" if c else n for n, c in LOADED])
def loaded(request):
    name, row_chunks = request.param
    d = FIXTURES / name
    model = trm.load_upstream_checkpoint(d / "step_0", d / "all_config.yaml")
    model.row_chunks = row_chunks
    if row_chunks:
        assert model.chunks_for(8) == row_chunks
    if NUM_DEVICES:
        from jaxport.distributed import make_mesh, replicate

        nnx.update(model, replicate(nnx.state(model), make_mesh(data=NUM_DEVICES)))
    return name, model


def test_training_calls_carry_state(loaded):
    """Three training-mode calls: halted rows take the next batch's rows, others keep state."""
    name, model = loaded
    model.train()
    _, exp = arrays(name)
    gbs = case(name)["config"]["global_batch_size"]
    carry = None
    for c in range(case(name)["n_train_calls"]):
        b = batch(name, f"train/b{c}")
        carry = model.initial_carry(b) if carry is None else carry
        carry, loss, metrics, outputs, all_finish = model(carry, b)
        check_call(name, f"train/c{c}", carry, loss, metrics, outputs, all_finish, "train")
        for metric, value in reduce_train_metrics(metrics, gbs).items():
            expected = exp[f"train/c{c}/train_batch/{metric}"]
            if metric.endswith("loss"):
                close(value, expected, loss_tol(name), metric)
            elif metric == "accuracy":
                close(value, expected, accuracy_tol(name), metric)
            else:
                assert value == pytest.approx(float(expected), rel=1e-12), metric


def test_eval_runs_to_max_steps(loaded):
    name, model = loaded
    model.eval()
    _, exp = arrays(name)

    def check(step, carry, loss, metrics, outputs):
        all_finish = jnp.all(carry.halted)
        check_call(name, f"eval/s{step}", carry, loss, metrics, outputs, all_finish, "eval")

    eval_batch = batch(name, "eval")
    _, num_steps = run_to_halt(model, eval_batch, on_step=check)
    assert num_steps == int(exp["eval/num_steps"]) == model.config.halt_max_steps
    # upstream's evaluate(): the final call's metrics summed per set in float32, divided by the count; here
    # over the batch's two halves (rows are independent in eval mode), so the sums run across batches
    host_batch = {k: arrays(name)[0][f"eval/{k}"] for k in BATCH_KEYS}
    half = len(host_batch["inputs"]) // 2
    parts = [{k: v[rows] for k, v in host_batch.items()} for rows in (slice(None, half), slice(half, None))]
    batches = [("all", eval_batch, host_batch)] if NUM_DEVICES else [("all", part, part) for part in parts]
    result, saved = evaluate(model, batches, save_keys=("preds", "puzzle_identifiers"))
    last = f"eval/s{num_steps - 1}"
    robust = exp[f"{last}/pred_gap"] >= case(name)["robustness"]["labels_ignored_where_top2_gap_below"]
    np.testing.assert_array_equal(saved["preds"][robust], exp[f"{last}/preds"][robust])
    np.testing.assert_array_equal(saved["puzzle_identifiers"], host_batch["puzzle_identifiers"])
    assert sorted(result) == sorted(
        f"all/{k}" for k in ("accuracy", "exact_accuracy", "lm_loss", "q_halt_accuracy", "q_halt_loss", "steps")
    )
    for key, value in result.items():
        metric = key.removeprefix("all/")
        expected = exp[f"eval/evaluate/{metric}"]
        tol = (
            loss_tol(name)
            if metric.endswith("loss")
            else accuracy_tol(name)
            if metric == "accuracy"
            else {"atol": 0, "rtol": 1e-7}
        )
        close(value, expected, tol, f"eval/evaluate/{metric}")
    model.train()


@pytest.mark.parametrize("call", [0, 1])
def test_gradients(loaded, call):
    """d(loss / global_batch_size) for every parameter and for the batch's puzzle-embedding rows."""
    name, model = loaded
    if "grad/*, grad_call1/*" not in per_group(name):
        pytest.skip("upstream records gradients for the float32 cases only")
    tol = per_group(name)["grad/*, grad_call1/*"]
    _, exp = arrays(name)
    model.train()
    gbs = case(name)["config"]["global_batch_size"]
    b0 = batch(name, "train/b0")
    carry = model.initial_carry(b0)
    if call == 1:  # weights are unchanged between the recorded calls
        carry, *_ = model(carry, b0)
    step = nnx.jit(loss_and_grad, static_argnums=3)
    _, (param_grads, row_grads) = step(model, carry, batch(name, f"train/b{call}"), gbs)
    prefix = "grad" if call == 0 else "grad_call1"
    flat = {".".join(str(p) for p in path): v for path, v in nnx.to_flat_state(param_grads)}
    recorded = [k for k in exp if k.startswith(prefix + "/")]
    assert recorded
    for key in recorded:
        name_in_model = key.split("model.inner.", 1)[1]
        got = row_grads if name_in_model == "puzzle_emb.local_weights" else flat["inner." + name_in_model][...]
        close(np.asarray(got), exp[key], tol, key)


def test_load_resizes_puzzle_embedding():
    """A config with more puzzle identifiers gets the saved table's row mean (upstream load_checkpoint)."""
    name = "att_rope_f32"
    _, exp = arrays(name)
    n = int(exp["load_resize/num_puzzle_identifiers"])
    d = FIXTURES / name
    model = trm.load_upstream_checkpoint(d / "step_0", d / "all_config.yaml", num_puzzle_identifiers=n)
    close(
        model.inner.puzzle_emb.weights[...],
        exp["load_resize/puzzle_emb_weights"],
        per_group(name)["ema/*, load_resize/*"],
        "load_resize",
    )


@pytest.mark.parametrize("name", MODEL_CASES)
def test_save_round_trip_is_upstream_format(name, tmp_path):
    """save -> upstream-format file with the original's keys, shapes and dtypes -> load gives the same model."""
    import torch

    d = FIXTURES / name
    model = trm.load_upstream_checkpoint(d / "step_0", d / "all_config.yaml")
    out = tmp_path / "run" / "step_7"
    trm.save_upstream_checkpoint(model, out)
    original = torch.load(d / "step_0", map_location="cpu", weights_only=True)
    written = torch.load(out, map_location="cpu", weights_only=True)
    assert list(written) == list(original)
    for key, tensor in original.items():
        assert written[key].shape == tensor.shape and written[key].dtype == tensor.dtype, key
        assert torch.equal(written[key], tensor), key
    again = trm.load_upstream_checkpoint(out, out.parent / "all_config.yaml")
    assert again.config == model.config
    model.eval()
    again.eval()
    b = batch(name, "eval")
    _, _, _, out_a, _ = model(model.initial_carry(b), b)
    _, _, _, out_b, _ = again(again.initial_carry(b), b)
    np.testing.assert_array_equal(np.asarray(out_a["logits"]), np.asarray(out_b["logits"]))


def test_unrolled_and_fori_loop_cycles_agree():
    name = "att_rope_f32"
    d = FIXTURES / name
    models = [trm.load_upstream_checkpoint(d / "step_0", d / "all_config.yaml", unroll_cycles=u) for u in (True, False)]
    b = batch(name, "eval")
    logits = []
    for m in models:
        m.eval()
        _, _, _, outputs, _ = m(m.initial_carry(b), b)
        logits.append(np.asarray(outputs["logits"]))
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-5)


def test_row_chunks_must_divide_the_batch():
    d = FIXTURES / "att_rope_f32"
    model = trm.load_upstream_checkpoint(d / "step_0", d / "all_config.yaml")
    model.row_chunks = 3
    b = batch("att_rope_f32", "eval")
    with pytest.raises(JaxportError, match="row_chunks=3 does not divide the batch of 8 rows"):
        model(model.initial_carry(b), b)


def test_stablemax_gradient_is_finite_where_a_logit_is_one():
    """Upstream computes stablemax in float64; in float32 the unused 1/(1-x) branch at x = 1 must not
    poison the gradient (it did: NaN weights after a few dozen steps of Sudoku training)."""
    from jaxport.trm.losses import stablemax_cross_entropy

    logits = jnp.array([[1.0, -0.5, 2.0], [0.3, 1.0, -2.0]], jnp.float32)
    labels = jnp.array([0, 2])
    grad = jax.grad(lambda x: stablemax_cross_entropy(x, labels, labels >= 0).sum())(logits)
    assert np.isfinite(np.asarray(grad)).all()
    x = np.asarray(logits, np.float64)
    s = np.where(x < 0, 1 / (1 - np.minimum(x, 0)), x + 1)
    expected = -np.log(s / s.sum(-1, keepdims=True))[[0, 1], [0, 2]]
    np.testing.assert_allclose(stablemax_cross_entropy(logits, labels, labels >= 0), expected, rtol=1e-6)
