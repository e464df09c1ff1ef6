"""The TRM parity tests again, with every batch sharded over a `data` axis of 8 fake CPU devices."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_parity_with_batch_sharded_over_8_devices():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAXPORT_TEST_SHARD_DEVICES": "8",
        "JAX_PLATFORMS": "cpu",
    }
    tests = Path(__file__).parent
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tests / "test_trm_model.py"),
            "-k",
            "training_calls or eval_runs or gradients",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tests,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
