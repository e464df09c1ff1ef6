"""bench/suite.py end to end at --tiny sizes, so the accelerator suite cannot rot: every family's rows are
measured, the originals' rows say why they did not run where torch has no CUDA, bench/gpu_gaps.py's study runs,
and both reports are written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SUITE = Path(__file__).resolve().parents[1] / "bench" / "suite.py"


def run_suite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=900)


def test_tiny_suite_reports_every_family_and_why_the_originals_did_not_run(tmp_path):
    proc = run_suite("--tiny", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "suite.json").read_text())
    markdown = (tmp_path / "suite.md").read_text()
    assert list(report["sections"]) == ["trm", "gpt", "dream"]
    originals = report["originals"]
    on_cpu = report["machine"]["platform"] == "cpu"
    if on_cpu:  # torch cannot have a CUDA device here, whatever REF_PY is
        assert not originals["available"] and originals["reason"]
    for family, rows in report["sections"].items():
        assert f"## {report['titles'][family]}" in markdown
        mine = [r for r in rows if r["side"] == "jaxport"]
        theirs = {r["workload"]: r for r in rows if r["side"] == "original"}
        assert mine and all(r["status"] == "ok" for r in mine), mine
        assert sorted(theirs) == sorted(r["workload"] for r in mine)  # one original row beside each
        for r in mine:
            assert r["device"] and r["versions"]["jax"] and r["memory_source"]
            for key in ("compile_s", "step_s", "throughput", "memory_bytes"):
                assert r[key] > 0, (family, r["workload"], key, r[key])
            assert f"| {r['workload']} | jaxport | {r['device']} |" in markdown
            if family in ("trm", "gpt") or r["workload"].startswith("exact"):  # FLOPs counted: utilisation
                assert r["achieved_gflops"] > 0 and 0 < r["fraction_of_peak"] and r["peak_source"]
            if family == "gpt" or r["workload"].startswith("exact"):
                assert r["mfu"] > 0
            if r["workload"].startswith("fast"):
                assert r["speedup_vs_exact"] > 0
        for label, r in theirs.items():
            if r["status"] != "ok":
                assert r["reason"], r
                assert f"| {label} | original | | | | | | | | | | {r['status']}: " in markdown
            if on_cpu:
                assert r["status"] == "not run"
                expected = "no fast decoding" if label.startswith("fast") else originals["reason"]
                assert expected in r["reason"]
    assert originals["available"] or originals["reason"].splitlines()[-1] in markdown
    gaps = report["gpu_gaps"]
    assert gaps["status"] == "ok" and gaps["tiny"], gaps
    assert sorted(gaps["gpt"]) == ["command buffers (XLA's default)", "no command buffers"]
    assert gaps["gpt"]["no command buffers"]["xla_flags"].endswith("--xla_gpu_enable_command_buffer=")
    for row in gaps["gpt"].values():
        assert row["read_every_iteration_s"] > 0 and row[f"read_every_{gaps['interval']}_s"] > 0
    assert gaps["trm"]["summary"]["ops_s_total"] > 0 and gaps["trm"]["top_ops"]
    assert "## GPU gaps (bench/gpu_gaps.py)" in markdown and (tmp_path / "gpu_gaps" / "gpu_gaps.md").is_file()


def test_unknown_family_is_one_clear_error(tmp_path):
    proc = run_suite("--only", "trm,llama", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "--only trm,llama: unknown llama; choose from trm, gpt, dream, gaps" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "suite.json").exists()


def test_a_family_past_its_timeout_is_stopped_and_the_report_says_so(tmp_path):
    proc = run_suite("--tiny", "--only", "gpt", "--skip-originals", "--timeout", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "suite.json").read_text())["sections"]["gpt"]
    stopped = [r for r in rows if r["side"] == "jaxport"]
    assert [r["status"] for r in stopped] == ["error"]
    assert stopped[0]["reason"].startswith("exit -9: ") and stopped[0]["reason"].endswith("stopped after --timeout 1 s")
    (line,) = [line for line in (tmp_path / "suite.md").read_text().splitlines() if "(the rest)" in line]
    assert "| error: " in line and line.endswith("stopped after --timeout 1 s |")  # after what the child printed
