"""The original `transformers` Dream code (transformers 4.46.2, ../shared/originals/dream) loads what
`jaxport dream export` writes, float32 in one file and bfloat16 in shards, with jaxport's logits.

It runs `tools/dream_export_check.py` under the originals' Python (`REF_PY`, `REF_DREAM`: `eval
"$(../shared/originals/setup)"`, which `.ci/run` does): transformers 4.46.2 needs tokenizers < 0.21 and
huggingface_hub < 1.0, older than the project's, so it cannot share the project's environment."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REF_PY, REF_DREAM = os.environ.get("REF_PY"), os.environ.get("REF_DREAM")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (REF_PY and REF_DREAM),
        reason="the original Dream code needs the originals' Python: REF_PY/REF_DREAM unset (eval \"$(../shared/"
        'originals/setup)" first; .ci/run does)',
    ),
]


def test_original_code_loads_jaxport_exports_with_the_same_logits():
    assert Path(REF_PY).is_file(), f"REF_PY={REF_PY}: no such file"
    assert (Path(REF_DREAM) / "modeling_dream.py").is_file(), f"REF_DREAM={REF_DREAM}: no modeling_dream.py"
    done = subprocess.run(
        [REF_PY, str(ROOT / "tools" / "dream_export_check.py"), "--jaxport-python", sys.executable],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["versions"]["transformers"] == "4.46.2"
    tolerance = json.loads((ROOT / "tests/fixtures/dream/tiny_sharded/case.json").read_text())["tolerances"]["logits"]
    assert report["tolerance"] == {"atol": tolerance["atol"], "rtol": tolerance["rtol"]}
    one_file, sharded = report["results"]
    assert (one_file["torch_dtype"], one_file["files"]) == ("float32", ["model.safetensors"])
    assert sharded["torch_dtype"] == "bfloat16" and "model.safetensors.index.json" in sharded["files"]
    assert len(sharded["files"]) > 2  # the index and several shards
    for result in report["results"]:
        for rows in ("plain", "padded"):
            assert result[rows]["within_tolerance"], (result["files"], rows, result[rows])
    assert done.returncode == 0, done.stderr[-3000:]
