"""Training parity: resuming nanoGPT's ckpt.pt reproduces its next two iterations
(fixtures/gpt/nanogpt_train_resume), and the checkpoints jaxport writes load in torch."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxport.checkpoint import load_torch_file, save_torch_file
from jaxport.gpt import settings as gpt_settings
from jaxport.gpt import trainer as gpt_trainer
from jaxport.training.step import LOSS_SCALE_GROWTH_INTERVAL

FIXTURES = Path(__file__).parent / "fixtures" / "gpt"
CASE = FIXTURES / "nanogpt_train_resume"


def resume_config(out_dir):
    case = json.loads((CASE / "case.json").read_text())
    cfg = {**gpt_settings.DEFAULTS, **gpt_settings.EXTRA, **case["train_config"]}
    cfg["out_dir"] = str(out_dir)
    return case, cfg


def resume_two_iterations(out, dtype="float32"):
    shutil.copy(CASE / "ckpt.pt", out / "ckpt.pt")
    case, cfg = resume_config(out)
    cfg["dtype"] = dtype
    x = np.load(CASE / "inputs.npz")
    trainer = gpt_trainer.Trainer(cfg, vocab_size=59)
    assert trainer.iter_num == 300
    lrs, losses, norms = [], [], []
    for it in range(2):
        lr = gpt_settings.get_lr(trainer.iter_num + it, cfg)
        micro, norm = trainer.step(x["train_x"][it], x["train_y"][it], lr)
        lrs.append(lr), losses.append(np.asarray(micro)), norms.append(float(norm))
    ckpt = trainer.checkpoint(302, 2.5, gpt_settings.get_lr(302, cfg))  # train.py saves after setting lr(302)
    return case, cfg, trainer, np.array(lrs), np.stack(losses), np.array(norms), ckpt


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return resume_two_iterations(tmp_path_factory.mktemp("resume"))


def assert_matches_nanogpt(resumed):
    case, cfg, trainer, lrs, losses, norms, ckpt = resumed
    e, tol = np.load(CASE / "expected.npz"), case["tolerances"]
    np.testing.assert_allclose(lrs, e["lr_iter"], rtol=tol["lr_iter"]["rtol"], atol=0)
    np.testing.assert_allclose(losses, e["micro_loss"], **tol["micro_loss"])
    np.testing.assert_allclose(norms, e["grad_norm"], **tol["grad_norm"])
    assert all(n > cfg["grad_clip"] for n in norms)  # clipping was active
    for key in e.files:
        kind, _, name = key.partition("/")
        if kind == "model":
            np.testing.assert_allclose(ckpt["model"][name], e[key], err_msg=key, **tol["model/*"])
    order = case["checkpoint_layout_resumed"]["optimizer_state_index_to_param"]
    state = ckpt["optimizer"]["state"]
    for i, name in enumerate(order):
        np.testing.assert_allclose(state[i]["exp_avg"], e[f"exp_avg/{name}"], err_msg=name, **tol["exp_avg/*"])
        np.testing.assert_allclose(state[i]["exp_avg_sq"], e[f"exp_avg_sq/{name}"], err_msg=name, **tol["exp_avg_sq/*"])
        assert state[i]["step"] == e["step"]


def test_lr_schedule():
    case, cfg = resume_config("out")
    e = np.load(CASE / "expected.npz")
    lrs = [gpt_settings.get_lr(int(it), cfg) for it in e["lr_schedule_its"]]
    np.testing.assert_allclose(lrs, e["lr_schedule"], rtol=case["tolerances"]["lr_schedule"]["rtol"], atol=0)


def compiled_step_text(trainer) -> str:
    x = np.load(CASE / "inputs.npz")
    args = trainer.step_args(x["train_x"][0], x["train_y"][0], 1e-3)
    return trainer._step.lower(*args).compile().as_text()


@pytest.mark.slow
def test_resume_two_iterations_match_nanogpt(resumed):
    """Small products compile as YNNPACK fusions of one dot each, and the LayerNorm, softmax and loss
    reductions stay plain reductions (XLA:CPU's windowed rewrite of them is slower)."""
    from jaxport.runtime import policy

    trainer = resumed[2]
    assert trainer.compiler_options == {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
        **policy.PLAIN_REDUCTIONS,
    }
    text = compiled_step_text(trainer)
    assert "ynn_fusion" in text and "reduce-window" not in text
    assert_matches_nanogpt(resumed)


@pytest.mark.slow
def test_large_step_compiles_without_ynnpack_dots_and_still_matches_nanogpt(tmp_path, monkeypatch):
    """A step with LARGE_MATMUL_ROWS rows or more (GPT's train_shakespeare_char step) compiles its float32 dots
    outside YNNPACK on a CPU, the faster path there; the fixture's rows stand in for a large step here."""
    from jaxport.runtime import policy

    monkeypatch.setattr(policy, "LARGE_MATMUL_ROWS", 1)
    resumed = resume_two_iterations(tmp_path)
    trainer = resumed[2]
    assert trainer.compiler_options == {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert "ynn_fusion" not in compiled_step_text(trainer)
    assert_matches_nanogpt(resumed)


@pytest.mark.slow
def test_written_checkpoint_matches_nanogpt_layout(resumed, tmp_path):
    case, cfg, trainer, lrs, losses, norms, ckpt = resumed
    save_torch_file(ckpt, tmp_path / "ckpt.pt")
    ours = load_torch_file(tmp_path / "ckpt.pt")
    theirs = load_torch_file(CASE / "ckpt_resumed.pt")
    assert set(ours) == set(theirs) and list(ours["model"]) == list(theirs["model"])
    assert ours["model_args"] == theirs["model_args"] and ours["iter_num"] == theirs["iter_num"] == 302
    assert ours["best_val_loss"].shape == () and ours["best_val_loss"].dtype == np.float32
    assert set(theirs["config"]) <= set(ours["config"])
    groups, their_groups = ours["optimizer"]["param_groups"], theirs["optimizer"]["param_groups"]
    for g, tg in zip(groups, their_groups):
        assert g.keys() == tg.keys() and g["params"] == tg["params"] and g["weight_decay"] == tg["weight_decay"]
        assert g["lr"] == pytest.approx(tg["lr"], rel=1e-12) and list(g["betas"]) == list(tg["betas"])
    for i, entry in theirs["optimizer"]["state"].items():
        assert {k: v.shape for k, v in ours["optimizer"]["state"][i].items()} == {k: v.shape for k, v in entry.items()}


@pytest.mark.slow
def test_written_checkpoint_loads_in_torch_adamw(resumed, tmp_path):
    """nanoGPT's resume calls optimizer.load_state_dict on our file: check torch accepts it and steps."""
    torch = pytest.importorskip("torch")
    case, cfg, trainer, *_, ckpt = resumed
    save_torch_file(ckpt, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    order = case["checkpoint_layout_resumed"]["optimizer_state_index_to_param"]
    params = {n: torch.nn.Parameter(loaded["model"][n].clone()) for n in order}
    decay = [params[n] for n in order if params[n].dim() >= 2]
    nodecay = [params[n] for n in order if params[n].dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99)
    )
    opt.load_state_dict(loaded["optimizer"])
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()
    assert float(opt.state[decay[0]]["step"]) == 303.0


@pytest.mark.slow
def test_float16_dynamic_loss_scaling(tmp_path, monkeypatch):
    """float16 as nanoGPT's GradScaler: overflowing steps are skipped and halve the scale."""
    import jax.numpy as jnp

    shutil.copy(CASE / "ckpt.pt", tmp_path / "ckpt.pt")
    _, cfg = resume_config(tmp_path)
    x = np.load(CASE / "inputs.npz")
    monkeypatch.setattr(gpt_trainer, "compute_dtype", lambda dtype, platform: jnp.float16)
    trainer = gpt_trainer.Trainer({**cfg, "dtype": "float16"}, vocab_size=59)
    assert float(trainer.loss_scale[0]) == 2.0**16
    before = np.asarray(trainer.params["wte"])
    trainer.loss_scale = (
        jnp.float32(2.0**120),
        jnp.int32(5),
    )  # (scale, finite steps in a row)  # overflows float16 activations' gradients
    _, norm = trainer.step(x["train_x"][0], x["train_y"][0], 1e-3)
    assert not np.isfinite(float(norm))
    np.testing.assert_array_equal(np.asarray(trainer.params["wte"]), before)
    assert float(trainer.loss_scale[0]) == 2.0**119 and int(trainer.loss_scale[1]) == 0
    trainer.loss_scale = (jnp.float32(2.0**16), jnp.int32(LOSS_SCALE_GROWTH_INTERVAL - 1))
    _, norm = trainer.step(x["train_x"][0], x["train_y"][0], 1e-3)
    assert np.isfinite(float(norm))
    assert not np.array_equal(np.asarray(trainer.params["wte"]), before)
    assert float(trainer.loss_scale[0]) == 2.0**17 and int(trainer.loss_scale[1]) == 0  # grown


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_iterations_match_nanogpt(dtype, tmp_path, monkeypatch):
    """nanoGPT's two resumed iterations as it runs them on a GPU with --dtype=bfloat16 or float16 (autocast,
    float16 with its GradScaler), fixtures/gpt/nanogpt_train_resume_<dtype>, within that case's tolerances;
    master weights and AdamW moments stay float32."""
    import jax.numpy as jnp

    low = FIXTURES / f"nanogpt_train_resume_{dtype}"
    case, e = json.loads((low / "case.json").read_text()), np.load(low / "expected.npz")
    tol = case["tolerances"]
    monkeypatch.setattr(gpt_trainer, "compute_dtype", lambda dtype, platform: jnp.dtype(dtype))  # as on a GPU
    _, cfg, trainer, lrs, losses, norms, ckpt = resume_two_iterations(tmp_path, dtype)
    assert trainer.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(lrs, np.load(CASE / "expected.npz")["lr_iter"], rtol=1e-12)
    np.testing.assert_allclose(losses, e["micro_loss"], **tol["micro_loss"])
    np.testing.assert_allclose(norms, e["grad_norm"], **tol["grad_norm"])
    # the tolerances also hold a float32 run; the products must really have run in the reduced precision
    float32_losses = np.load(CASE / "expected.npz")["micro_loss"]
    assert np.max(np.abs(np.ravel(losses) / np.ravel(float32_losses) - 1)) > 1e-5, (losses, float32_losses)
    assert float(trainer.loss_scale[0]) == e["loss_scale"][-1]  # float16: 2**16, no overflow; bfloat16: 1
    gaps = np.concatenate([np.ravel(ckpt["model"][k[6:]] - e[k]) for k in e.files if k.startswith("model/")])
    assert np.sqrt(np.mean(gaps**2)) <= tol["model/*"]["rms"], (np.sqrt(np.mean(gaps**2)), tol["model/*"])
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(trainer.params))
    assert trainer.adam_state().mu["wte"].dtype == jnp.float32


DP_SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys
    import numpy as np, jax
    from jaxport.gpt import settings as gpt_settings
    from jaxport.gpt import train as gpt_train
    from jaxport.gpt import trainer as gpt_trainer
    case_dir, out = sys.argv[1], sys.argv[2]
    case = json.load(open(case_dir + "/case.json"))
    cfg = {**gpt_settings.DEFAULTS, **gpt_settings.EXTRA, **case["train_config"], "out_dir": out}
    shutil.copy(case_dir + "/ckpt.pt", out + "/ckpt.pt")
    x = np.load(case_dir + "/inputs.npz")
    # 2 micro-steps of batch 8 (both recorded iterations side by side), split 8 ways or not at all
    X, Y = (np.concatenate([x[k][0], x[k][1]], axis=1) for k in ("train_x", "train_y"))
    results = {}
    for name, n, fsdp in (("dp1", 1, 1), ("dp8", 8, 1), ("fsdp4", 8, 4)):
        trainer = gpt_trainer.Trainer({**cfg, "fsdp": fsdp}, vocab_size=59, devices=jax.devices()[:n])
        for it in range(2):  # the second step reuses the first's shardings
            losses, norm = trainer.step(X, Y, 1e-3)
        wte = trainer.params["h"][0]["mlp"]["c_fc"]["weight"]
        results.update({f"losses_{name}": np.asarray(losses), f"norm_{name}": float(norm),
                        f"w_{name}": np.asarray(wte),
                        f"wshards_{name}": len({str(s.index) for s in wte.addressable_shards}),
                        f"shards_{name}": len(trainer._shard(X)[0].sharding.device_set),
                        f"compiles_{name}": trainer._step._cache_size()})
    np.savez(out + "/result.npz", **results)

    # the loop shares out accumulation steps like nanoGPT's DDP: 8 steps of 2 rows -> 1 step of 16
    rng = np.random.default_rng(0)
    os.makedirs(out + "/data/tiny")
    for split in ("train", "val"):
        rng.integers(0, 59, 3000).astype(np.uint16).tofile(out + f"/data/tiny/{split}.bin")
    small = {**cfg, "init_from": "scratch", "dataset": "tiny", "data_dir": out + "/data", "out_dir": out + "/run",
             "n_layer": 1, "batch_size": 2, "gradient_accumulation_steps": 8, "max_iters": 1,
             "eval_interval": 1, "eval_iters": 1, "progress": False, "device": "cpu"}
    gpt_train.train(small)
    try:
        gpt_train.train({**small, "gradient_accumulation_steps": 4})
    except Exception as err:
        print("ERROR:", err)
""")


@pytest.mark.slow
def test_data_parallel_and_fsdp_on_8_devices_equal_1_device(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", DP_SCRIPT, str(CASE), str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = np.load(tmp_path / "result.npz")
    assert "tokens per iteration will be: 512" in proc.stdout  # 8 accumulation steps x 2 rows x 32 ids
    assert "ERROR: gradient_accumulation_steps=4 must be a multiple of the 8 devices" in proc.stdout
    assert (tmp_path / "run" / "ckpt.pt").exists()
    assert (int(r["shards_dp1"]), int(r["shards_dp8"]), int(r["shards_fsdp4"])) == (1, 8, 8)
    assert (int(r["wshards_dp8"]), int(r["wshards_fsdp4"])) == (1, 4)  # FSDP splits the weights 4 ways
    for name in ("dp8", "fsdp4"):
        assert int(r[f"compiles_{name}"]) == 1
        np.testing.assert_allclose(r[f"losses_{name}"], r["losses_dp1"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r[f"norm_{name}"], r["norm_dp1"], rtol=1e-5)
        np.testing.assert_allclose(r[f"w_{name}"], r["w_dp1"], rtol=1e-5, atol=1e-6)
    start = load_torch_file(CASE / "ckpt.pt")["model"]["transformer.h.0.mlp.c_fc.weight"]
    assert not np.allclose(r["w_dp1"], start)


MULTIHOST_SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys
    import numpy as np, jax
    from jaxport.distributed import fetch_replicated, initialize
    initialize()  # from JAXPORT_COORDINATOR, JAXPORT_NUM_PROCESSES, JAXPORT_PROCESS_ID
    from jaxport.gpt import settings as gpt_settings
    from jaxport.gpt import trainer as gpt_trainer
    case_dir, out = sys.argv[1], sys.argv[2]
    pid = jax.process_index()
    case = json.load(open(case_dir + "/case.json"))
    cfg = {**gpt_settings.DEFAULTS, **gpt_settings.EXTRA, **case["train_config"], "out_dir": out}
    x = np.load(case_dir + "/inputs.npz")
    trainer = gpt_trainer.Trainer(cfg, vocab_size=59, devices=jax.devices())
    losses, norms = [], []
    for it in range(2):  # this process feeds rows 2*pid, 2*pid+1 of each recorded micro-batch
        rows = slice(2 * pid, 2 * pid + 2)
        micro, norm = trainer.step(x["train_x"][it][:, rows], x["train_y"][it][:, rows],
                                   gpt_settings.get_lr(300 + it, cfg))
        losses.append(fetch_replicated(micro)), norms.append(float(fetch_replicated(norm)))
    ckpt = trainer.checkpoint(302, 2.5, gpt_settings.get_lr(302, cfg))
    if pid == 0:
        np.savez(out + "/multihost.npz", micro_loss=np.stack(losses), grad_norm=np.array(norms),
                 devices=jax.device_count(), processes=jax.process_count(),
                 **{"model/" + k: v for k, v in ckpt["model"].items()},
                 **{f"exp_avg_sq/{i}": s["exp_avg_sq"] for i, s in ckpt["optimizer"]["state"].items()})
""")


@pytest.mark.slow
def test_two_processes_reproduce_nanogpt_resume(tmp_path):
    """2 processes x 2 CPU devices (jax.distributed over localhost), each loading half the rows."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shutil.copy(CASE / "ckpt.pt", tmp_path / "ckpt.pt")
    procs = []
    for pid in range(2):
        env = {
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "JAX_PLATFORMS": "cpu",
            "JAXPORT_COORDINATOR": f"127.0.0.1:{port}",
            "JAXPORT_NUM_PROCESSES": "2",
            "JAXPORT_PROCESS_ID": str(pid),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", MULTIHOST_SCRIPT, str(CASE), str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    case = json.loads((CASE / "case.json").read_text())
    e, r, tol = np.load(CASE / "expected.npz"), np.load(tmp_path / "multihost.npz"), case["tolerances"]
    assert (int(r["devices"]), int(r["processes"])) == (4, 2)
    np.testing.assert_allclose(r["micro_loss"], e["micro_loss"], **tol["micro_loss"])
    np.testing.assert_allclose(r["grad_norm"], e["grad_norm"], **tol["grad_norm"])
    for key in e.files:
        if key.startswith("model/"):
            np.testing.assert_allclose(r[key], e[key], err_msg=key, **tol["model/*"])
    order = case["checkpoint_layout_resumed"]["optimizer_state_index_to_param"]
    for i, name in enumerate(order):
        np.testing.assert_allclose(r[f"exp_avg_sq/{i}"], e[f"exp_avg_sq/{name}"], **tol["exp_avg_sq/*"])
