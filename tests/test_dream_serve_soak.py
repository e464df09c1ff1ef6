"""bench/dream_serve_soak.py for 24 seconds on the tiny fixture (a real server on 127.0.0.1, continuous batching):
the goals it checks hold, measured from its first sample."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SOAK = Path(__file__).resolve().parents[1] / "bench" / "dream_serve_soak.py"


def test_a_short_soak_meets_its_goals(tmp_path):
    out = tmp_path / "soak.json"
    command = [sys.executable, str(SOAK), "--minutes", "0.4", "--sample-seconds", "6", "--baseline-minutes", "0"]
    # one prompt bucket x 2 batch sizes: two running-batch programs compiled at start-up
    command += ["--clients", "4", "--max-batch", "2", "--prompt-buckets", "48", "--max-tokens", "4..8"]
    command += ["--min-requests", "30", "--log", str(tmp_path / "server"), "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.exists(), done.stderr[-4000:]
    summary = json.loads(out.read_text())
    failed = {name: goal for name, goal in summary["goals"].items() if not goal["pass"]}
    assert not failed, failed
    assert done.returncode == 0 and summary["server_exit_code"] == 0

    # a JSON line per sample, then the summary; each sample read the server's /proc and /metrics
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[:-1] == summary["samples"] and lines[-1]["passed"] and len(summary["samples"]) >= 3
    for sample in summary["samples"]:
        assert sample["rss_mib"] > 0 and sample["mappings"] > 0 and sample["open_files"] > 0 and sample["threads"] > 1
        assert sample["status"]["200"] > 0
    # the mix held every kind of request: streams closed mid-way, prompts past the largest bucket, bad bodies
    kinds = summary["by_kind"]
    assert kinds["disconnect: 200"] and kinds["stream: 200"] and kinds["chat: 200"] and kinds["complete: 200"]
    assert kinds.get("complete: 400", 0) + kinds.get("stream: 400", 0) + kinds.get("disconnect: 400", 0) > 0
    assert sum(count for kind, count in kinds.items() if kind.startswith("bad: ")) > 0
