"""Bad input to TRM checkpoint loading gives one JaxportError naming the file, key and shapes."""

import shutil

import pytest
import yaml
from trm_fixtures import FIXTURES

from jaxport import trm
from jaxport.errors import JaxportError

CASE = FIXTURES / "att_rope_f32"


@pytest.fixture
def run_dir(tmp_path):
    shutil.copy(CASE / "step_0", tmp_path / "step_0")
    shutil.copy(CASE / "all_config.yaml", tmp_path / "all_config.yaml")
    return tmp_path


def load(run_dir, checkpoint="step_0"):
    return trm.load_upstream_checkpoint(run_dir / checkpoint, run_dir / "all_config.yaml")


def edit_config(run_dir, **arch_changes):
    config = yaml.safe_load((run_dir / "all_config.yaml").read_text())
    config["arch"].update(arch_changes)
    (run_dir / "all_config.yaml").write_text(yaml.safe_dump(config))


def test_missing_checkpoint(run_dir):
    with pytest.raises(JaxportError, match=r"TRM checkpoint not found: .*step_9"):
        load(run_dir, "step_9")


def test_missing_config(run_dir):
    (run_dir / "all_config.yaml").unlink()
    with pytest.raises(JaxportError, match=r"config file not found: .*all_config.yaml"):
        load(run_dir)


def test_truncated_checkpoint(run_dir):
    data = (run_dir / "step_0").read_bytes()
    (run_dir / "step_0").write_bytes(data[: len(data) // 2])
    with pytest.raises(JaxportError, match=r"truncated or not a PyTorch checkpoint.*step_0"):
        load(run_dir)


def test_corrupt_checkpoint(run_dir):
    data = bytearray((run_dir / "step_0").read_bytes())
    data[len(data) // 3 : len(data) // 3 + 4096] = bytes(4096)  # damage tensor data, keep the zip directory
    (run_dir / "step_0").write_bytes(bytes(data))
    with pytest.raises(JaxportError, match=r"corrupt or truncated.*step_0"):
        load(run_dir)


def test_not_a_checkpoint(run_dir):
    (run_dir / "step_0").write_text("hello")
    with pytest.raises(JaxportError, match=r"not a PyTorch checkpoint.*step_0"):
        load(run_dir)


def test_checkpoint_of_another_architecture(run_dir):
    edit_config(run_dir, mlp_t=True)
    with pytest.raises(
        JaxportError,
        match=r"step_0 does not fit the config.*mlp_t=True.*missing "
        r"L_level.layers.0.mlp_t.gate_up_proj.weight.*unexpected "
        r"L_level.layers.0.self_attn.qkv_proj.weight",
    ):
        load(run_dir)


@pytest.mark.slow
def test_checkpoint_shape_does_not_fit_config(run_dir):
    edit_config(run_dir, expansion=8)
    with pytest.raises(
        JaxportError,
        match=r"step_0: tensor L_level.layers.0.mlp.gate_up_proj.weight has shape "
        r"\[512, 64\], but the config needs \[1024, 64\]",
    ):
        load(run_dir)


def test_unknown_config_key_lists_close_matches(run_dir):
    edit_config(run_dir, hiden_size=64)
    with pytest.raises(
        JaxportError,
        match=r"unknown TRM config key 'hiden_size' in .*all_config.yaml; "
        r"did you mean hidden_size",
    ):
        load(run_dir)


def test_invalid_yaml(run_dir):
    (run_dir / "all_config.yaml").write_text("arch: [unclosed\n")
    with pytest.raises(JaxportError, match=r"not valid YAML: .*all_config.yaml"):
        load(run_dir)
