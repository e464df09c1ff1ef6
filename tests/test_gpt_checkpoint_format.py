"""nanoGPT's ckpt.pt both ways: a checkpoint written by nanoGPT's slow attention path (with the
`attn.bias` causal-mask buffers) loads to the same model as one without them, and the ckpt.pt jaxport
writes (`jaxport gpt train` and `jaxport gpt export`) has the keys, order, types, shapes and dtypes the
fixtures record from nanoGPT's own train.py."""

import collections
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxport import cli, gpt

torch = pytest.importorskip("torch")

FIXTURES = Path(__file__).parent / "fixtures" / "gpt"
CASES = ("nanogpt_ckpt", "nanogpt_ckpt_nobias", "nanogpt_ckpt_orig_mod")


pytestmark = pytest.mark.usefixtures("keep_malloc_defaults")


def case(name: str) -> dict:
    return json.loads((FIXTURES / name / "case.json").read_text())


def with_mask_buffers(state_dict: dict, block_size: int) -> collections.OrderedDict:
    """nanoGPT's state dict as its non-flash attention saves it: each attention module's `bias` buffer, the
    [1, 1, T, T] causal mask, follows the module's parameters."""
    out = collections.OrderedDict()
    for key, value in state_dict.items():
        out[key] = value
        if key.endswith("attn.c_proj.bias") or (
            key.endswith("attn.c_proj.weight") and key.replace("weight", "bias") not in state_dict
        ):
            out[key.replace("c_proj.weight", "bias").replace("c_proj.bias", "bias")] = torch.tril(
                torch.ones(block_size, block_size)
            ).view(1, 1, block_size, block_size)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_attention_mask_buffers_are_ignored_on_load(name, tmp_path):
    ckpt = torch.load(FIXTURES / name / "ckpt.pt", map_location="cpu", weights_only=True)
    block_size = ckpt["model_args"]["block_size"]
    ckpt["model"] = with_mask_buffers(ckpt["model"], block_size)
    buffers = [k for k in ckpt["model"] if k.endswith(".attn.bias")]
    assert len(buffers) == ckpt["model_args"]["n_layer"]
    torch.save(ckpt, tmp_path / "ckpt.pt")
    plain, masked = gpt.GPT.from_checkpoint(FIXTURES / name / "ckpt.pt"), gpt.GPT.from_checkpoint(tmp_path)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(plain)), nnx.to_flat_state(nnx.state(masked))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    idx = np.load(FIXTURES / name / "inputs.npz")["idx"]
    np.testing.assert_array_equal(np.asarray(plain(idx)[0]), np.asarray(masked(idx)[0]))
    # training resumes from it too (the loader train.py's --init_from=resume uses)
    from jaxport.gpt.model import load_checkpoint

    assert load_checkpoint(tmp_path / "ckpt.pt").iter_num == ckpt["iter_num"]


def layout(ckpt: dict) -> dict:
    """What case.json's checkpoint_layout records about a ckpt.pt, computed from a loaded one."""
    groups = ckpt["optimizer"]["param_groups"]
    entry = ckpt["optimizer"]["state"][0]
    return {
        "top_level_keys": list(ckpt),
        "types": {k: type(v).__name__ for k, v in ckpt.items()},
        "model_state_dict": [
            {"key": k, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            for k, v in ckpt["model"].items()
        ],
        "group_keys": [sorted(g) for g in groups],
        "group_params": [g["params"] for g in groups],
        "state_entries": len(ckpt["optimizer"]["state"]),
        "state_entry_keys": {k: [type(v).__name__, list(v.shape)] for k, v in entry.items()},
        "best_val_loss": (ckpt["best_val_loss"].dim(), ckpt["best_val_loss"].dtype),
    }


def recorded_layout(name: str) -> dict:
    recorded = case(name)["checkpoint_layout"]
    groups = recorded["optimizer_param_groups"]
    return {
        "top_level_keys": recorded["top_level_keys"],
        "types": recorded["types"],
        "model_state_dict": recorded["model_state_dict"],
        "group_keys": [sorted(g) for g in groups],
        "group_params": [g["params"] for g in groups],
        "state_entries": len(recorded["optimizer_state_index_to_param"]),
        "state_entry_keys": recorded["optimizer_state_entry_keys"],
        "best_val_loss": (0, torch.float32),  # "0-d torch.Tensor (float32) produced by losses.mean()"
    }


def assert_written_like_nanogpt(path: Path, name: str) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ours, theirs = layout(ckpt), recorded_layout(name)
    for key in theirs:
        assert ours[key] == theirs[key], key
    assert ckpt["model_args"] == case(name)["model_args"]
    assert set(case(name)["checkpoint_config"]) <= set(ckpt["config"])
    assert torch.equal(ckpt["model"]["lm_head.weight"], ckpt["model"]["transformer.wte.weight"])  # tied
    return ckpt


@pytest.mark.parametrize("name", ["nanogpt_ckpt", "nanogpt_ckpt_nobias"])
def test_written_checkpoint_has_nanogpts_layout(name, tmp_path):
    """The writer `jaxport gpt train` and `export` share (`gpt.params.nanogpt_checkpoint`, saved atomically), on a
    model of each recorded configuration."""
    from jaxport.gpt import settings as gpt_settings
    from jaxport.gpt import trainer as gpt_trainer
    from jaxport.gpt.params import write_nanogpt_checkpoint

    shutil.copy(FIXTURES / name / "ckpt.pt", tmp_path / "ckpt.pt")
    cfg = {
        **gpt_settings.DEFAULTS,
        **gpt_settings.EXTRA,
        **case(name)["train_config"],
        "out_dir": str(tmp_path),
        "init_from": "resume",
    }
    trainer = gpt_trainer.Trainer(cfg, vocab_size=case(name)["model_args"]["vocab_size"])
    write_nanogpt_checkpoint(trainer, tmp_path / "out", trainer.iter_num, trainer.best_val_loss, 1e-3)
    ckpt = assert_written_like_nanogpt(tmp_path / "out" / "ckpt.pt", name)
    original = torch.load(FIXTURES / name / "ckpt.pt", map_location="cpu", weights_only=True)
    for key, value in original["model"].items():  # a resumed, untrained model writes back the same weights
        assert torch.equal(ckpt["model"][key], value), key
    assert ckpt["iter_num"] == original["iter_num"]


@pytest.mark.slow
def test_train_and_export_write_nanogpts_layout(tmp_path, monkeypatch):
    """`jaxport gpt train` on data with the fixture's 59-character vocabulary, then `jaxport gpt export`."""
    name = "nanogpt_ckpt"
    data = tmp_path / "data" / "tinychar"
    data.mkdir(parents=True)
    shutil.copy(FIXTURES / name / "meta.pkl", data / "meta.pkl")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 59, 2000).astype(np.uint16).tofile(data / f"{split}.bin")
    model_args = case(name)["model_args"]
    flags = [f"--{k}={v}" for k, v in model_args.items() if k != "vocab_size"]
    monkeypatch.chdir(tmp_path)
    assert (
        cli.main(
            [
                "gpt",
                "train",
                "--device=cpu",
                "--dataset=tinychar",
                "--out_dir=run",
                "--batch_size=2",
                "--gradient_accumulation_steps=1",
                "--max_iters=2",
                "--eval_interval=2",
                "--eval_iters=1",
                "--progress=False",
                *flags,
            ]
        )
        == 0
    )
    trained = assert_written_like_nanogpt(tmp_path / "run" / "ckpt.pt", name)
    (tmp_path / "run" / "ckpt.pt").unlink()
    assert cli.main(["gpt", "export", "--out_dir=run"]) == 0
    exported = assert_written_like_nanogpt(tmp_path / "run" / "ckpt.pt", name)
    for key, value in trained["model"].items():
        assert torch.equal(exported["model"][key], value), key
    assert exported["iter_num"] == trained["iter_num"] == 2
