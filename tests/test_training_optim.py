"""Adam-atan2, sparse sign-SGD, the warmup+cosine schedule and EMA against numbers recorded
from upstream TRM (the optimizer arrays of the model cases' expected.npz; parameters from step_0)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxport.training import (
    adam_atan2,
    compute_lr,
    cosine_schedule_with_warmup_lr_lambda,
    ema_copy,
    ema_init,
    ema_update,
    sparse_sign_sgd_update,
    warmup_cosine_schedule,
)

FIXTURES = Path(__file__).parent / "fixtures" / "trm"
CASES = ["att_rope_f32", "mlp_t_f32", "att_learned_bf16"]
ADAM_CASES = ["att_rope_f32", "mlp_t_f32"]


def load(case):
    """expected.npz arrays, plus the checkpoint tensors under `checkpoint/<upstream key>`."""
    from jaxport.checkpoint import load_torch_file

    with np.load(FIXTURES / case / "expected.npz") as f:
        arrays = {k: f[k] for k in f.files}
    checkpoint = load_torch_file(FIXTURES / case / "step_0")
    return arrays | {f"checkpoint/{k}": np.asarray(v, np.float32) for k, v in checkpoint.items()}


def close(actual, expected, atol, rtol):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), atol=atol, rtol=rtol)


@pytest.mark.slow
@pytest.mark.parametrize("case", ADAM_CASES)
def test_adam_atan2_two_steps(case):
    e = load(case)
    # Adam-atan2 trains the parameters: the checkpoint tensors that have gradients (not the buffers).
    names = [k.removeprefix("checkpoint/") for k in e if k.startswith("checkpoint/") and f"grad/{k[11:]}" in e]
    params = {n: jnp.asarray(e[f"checkpoint/{n}"]) for n in names}
    b1, b2 = (float(x) for x in e["adam/betas"])
    opt = adam_atan2(float(e["adam/lr"]), b1=b1, b2=b2, weight_decay=float(e["adam/weight_decay"]))
    state = opt.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(*opt.update(g, s, p)))
    checked = 0
    for k, grad_prefix in ((1, "grad"), (2, "grad_call1")):
        grads = {n: jnp.asarray(e[f"{grad_prefix}/{n}"]) for n in names}
        params, state = step(params, state, grads)
        for n in names:
            if f"adam/step{k}/{n}" in e:
                close(params[n], e[f"adam/step{k}/{n}"], atol=1e-6, rtol=1e-5)
                checked += 1
    assert checked >= len(names) + 4  # every parameter after step 2, the small ones after step 1


@pytest.mark.slow
def test_adam_atan2_schedule_and_inject_hyperparams():
    params = {"w": jnp.ones((3,))}
    grads = {"w": jnp.array([1.0, -2.0, 0.0])}
    sched = warmup_cosine_schedule(1e-2, num_warmup_steps=4, num_training_steps=10)
    opt = adam_atan2(sched, weight_decay=0.5)
    updates, _ = opt.update(grads, opt.init(params), params)
    lr = 1e-2 * 1 / 4  # the first update runs at upstream step 1
    expected = -lr * (np.arctan2([1.0, -2.0, 0.0], [1.0, 2.0, 0.0]) + 0.5)
    close(updates["w"], expected, atol=1e-8, rtol=1e-6)
    injected = optax.inject_hyperparams(adam_atan2)(learning_rate=lr, weight_decay=0.5)
    updates2, _ = injected.update(grads, injected.init(params), params)
    close(updates2["w"], expected, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_sparse_sign_sgd_matches_upstream(case):
    e = load(case)
    ids = e["signsgd/local_ids"]
    assert len(set(ids.tolist())) < len(ids)  # the recorded batch has duplicate ids
    new = jax.jit(sparse_sign_sgd_update)(
        jnp.asarray(e["signsgd/weights_before"]),
        jnp.asarray(ids),
        jnp.asarray(e["signsgd/local_weights_grad"]),
        float(e["signsgd/lr"]),
        float(e["signsgd/weight_decay"]),
    )
    close(new, e["signsgd/weights_after"], atol=1e-7, rtol=1e-6)


@pytest.mark.slow
def test_sparse_sign_sgd_duplicates_and_untouched_rows():
    w = np.arange(12, dtype=np.float32).reshape(6, 2)
    ids = np.array([4, 1, 4, 4], np.int32)
    g = np.array([[1.0, -1.0], [-3.0, 0.0], [-2.5, 2.0], [0.5, 0.5]], np.float32)
    lr, wd = 0.1, 0.5
    new = np.asarray(sparse_sign_sgd_update(jnp.asarray(w), jnp.asarray(ids), jnp.asarray(g), lr, wd))
    expected = w.copy()
    expected[4] = w[4] * (1 - lr * wd) - lr * np.sign([-1.0, 1.5])  # summed before the sign
    expected[1] = w[1] * (1 - lr * wd) - lr * np.sign([-3.0, 0.0])  # sign(0) = 0: decay only
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    np.testing.assert_array_equal(new[[0, 2, 3, 5]], w[[0, 2, 3, 5]])  # absent ids: no decay


@pytest.mark.parametrize("case", CASES)
def test_lr_grids(case):
    e = load(case)
    kwargs = {
        "a": dict(base_lr=1e-3, num_warmup_steps=10, num_training_steps=100, min_ratio=0.0),
        "b": dict(base_lr=1e-3, num_warmup_steps=10, num_training_steps=100, min_ratio=0.1),
        "c": dict(base_lr=2e-4, num_warmup_steps=0, num_training_steps=50, min_ratio=0.25, num_cycles=1.0),
    }
    for name, kw in kwargs.items():
        got = [cosine_schedule_with_warmup_lr_lambda(int(s), **kw) for s in e["lr/grid_steps"]]
        np.testing.assert_allclose(got, e[f"lr/grid_{name}"], rtol=1e-12, atol=0)
        # the jit-able schedule gives the same curve (float32), shifted by one update
        sched = warmup_cosine_schedule(
            kw["base_lr"],
            num_warmup_steps=kw["num_warmup_steps"],
            num_training_steps=kw["num_training_steps"],
            min_ratio=kw["min_ratio"],
            num_cycles=kw.get("num_cycles", 0.5),
        )
        steps = e["lr/grid_steps"][1:]
        np.testing.assert_allclose(
            np.asarray(sched(jnp.asarray(steps - 1))), e[f"lr/grid_{name}"][1:], rtol=1e-5, atol=1e-9
        )


@pytest.mark.parametrize("case", CASES)
def test_compute_lr_with_case_config(case):
    e = load(case)
    total = int(e["lr/config_total_steps"])
    for key, base in (("config_lr", 1e-4), ("config_puzzle_emb_lr", 1e-2)):
        got = [
            compute_lr(base, step=int(s), total_steps=total, lr_warmup_steps=2000, lr_min_ratio=1.0)
            for s in e["lr/config_steps"]
        ]
        np.testing.assert_allclose(got, e[f"lr/{key}"], rtol=1e-12, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_ema_with_frozen_parameter(case):
    e = load(case)
    mu = float(e["ema/mu"])
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    params = {n: jnp.asarray(e[f"ema/init/{n}"]) for n in names}
    trainable = {n: n != "1.bias" for n in names}
    traced = jax.jit(ema_update, static_argnums=2)  # the mask as boolean arrays through jit
    shadow = shadow_jit = ema_init(params)
    for u in range(3):
        params = {n: params[n] + e[f"ema/update{u}/delta/{n}"] for n in names}
        shadow = ema_update(shadow, params, mu, trainable)
        shadow_jit = traced(shadow_jit, params, mu, {n: jnp.array(t) for n, t in trainable.items()})
        for n in names:
            if trainable[n]:
                close(shadow[n], e[f"ema/update{u}/shadow/{n}"], atol=1e-7, rtol=1e-6)
                close(shadow_jit[n], e[f"ema/update{u}/shadow/{n}"], atol=1e-7, rtol=1e-6)
    for evaluated in (
        ema_copy(shadow, params, trainable),
        jax.jit(ema_copy)(shadow_jit, params, {n: jnp.array(t) for n, t in trainable.items()}),
    ):
        for n in names:
            close(evaluated[n], e[f"ema/ema_copy/{n}"], atol=1e-7, rtol=1e-6)
        assert not np.allclose(evaluated["1.bias"], e["ema/init/1.bias"])  # frozen: current value, not the start


SHARDED_SIGN_SGD = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxport.training import sparse_sign_sgd_update
assert jax.device_count() == 8
rng = np.random.RandomState(0)
w = rng.randn(20, 4).astype(np.float32)
ids = rng.randint(0, 6, size=16).astype(np.int32)  # many duplicates, spread over devices
g = rng.randn(16, 4).astype(np.float32)
mesh = Mesh(np.array(jax.devices()), ("data",))
step = jax.jit(sparse_sign_sgd_update, out_shardings=NamedSharding(mesh, P()))
sharded = step(jax.device_put(w, NamedSharding(mesh, P())), jax.device_put(ids, NamedSharding(mesh, P("data"))),
               jax.device_put(g, NamedSharding(mesh, P("data"))), 0.1, 0.5)
single = sparse_sign_sgd_update(w, ids, g, 0.1, 0.5)
np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-6, atol=1e-7)  # fused or not
assert not np.allclose(np.asarray(single), w)
print("ok")
"""


@pytest.mark.slow
def test_sparse_sign_sgd_with_batch_sharded_over_8_devices():
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", SHARDED_SIGN_SGD], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
