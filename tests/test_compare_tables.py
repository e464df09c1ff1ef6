"""The speed tables of README.md and docs/performance.md are bench/compare.py's stored results, rendered: a table
edited by hand, or results stored without refreshing the documents, fails here."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import compare_tables  # noqa: E402  (bench/ is a folder of scripts, not a package)


@pytest.mark.parametrize("document", compare_tables.DOCUMENTS)
def test_every_generated_table_is_what_its_stored_results_render(document):
    text = (REPO / document).read_text()
    blocks = list(compare_tables.BLOCK.finditer(text))
    assert blocks, f"{document} has no generated table"
    assert compare_tables.stale_blocks(text) == [], "run python bench/compare_tables.py"


def test_the_readme_shows_one_generated_table_of_ratios_beside_the_goals():
    (block,) = compare_tables.BLOCK.finditer((REPO / "README.md").read_text())
    assert "style=ratios" in block.group("args")
    assert "| workload | goal |" in block.group("body")


def test_a_stale_table_is_found_and_rewritten_from_the_results(tmp_path, monkeypatch):
    results = json.loads((REPO / "bench/results/amd-epyc-2core.json").read_text())
    results["records"][0]["ratio"] = 9.99
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench/r.json").write_text(json.dumps(results))
    monkeypatch.setattr(compare_tables, "REPO", tmp_path)
    document = "before\n<!-- compare:begin results=bench/r.json -->\n| old |\n<!-- compare:end -->\nafter\n"
    assert compare_tables.stale_blocks(document) == ["results=bench/r.json"]
    rewritten = compare_tables.refreshed(document)
    assert "**9.99**" in rewritten and "| old |" not in rewritten
    assert rewritten.startswith("before\n") and rewritten.endswith("<!-- compare:end -->\nafter\n")
    assert compare_tables.stale_blocks(rewritten) == []


def test_compile_time_and_the_tokens_verdict_beside_every_ratio():
    """A stored record without a compile time or a verdict says so; None is a timed run that includes compiling."""
    base = {"original_s": 2.0, "jaxport_s": 1.0, "ratio": 2.0, "original_peak_rss": 2**20, "jaxport_peak_rss": 2**21}
    verdict = {"rows_equal": "7/8", "rows_differing_after_a_near_tie": [], "rows_differing_otherwise": [3]}
    records = [
        {**base, "workload": "judged", "jaxport_compile_s": 4.5, "tokens": {**verdict, "passed": False}},
        {**base, "workload": "compiled in the time", "jaxport_compile_s": None, "rows_equal": "2/4"},
        {**base, "workload": "stored without either", "rows_equal": "4/4"},
    ]
    lines = compare_tables.markdown_table(records).splitlines()
    assert lines[0].startswith("| workload | original (s) | jaxport (s) | ratio | jaxport compile (s) |")
    assert "| **2.00** | 4.5 |" in lines[2] and "| 7/8 equal, FAIL |" in lines[2]
    assert "| **2.00** | in the time |" in lines[3] and "| 2/4 | not recorded |" in lines[3]
    assert "| **2.00** | not recorded |" in lines[4] and "| 4/4 | not recorded |" in lines[4]
    run = {"short": "host", "records": records}
    ratios = compare_tables.ratios_table([run]).splitlines()
    assert ratios[0] == "| workload | goal | host | host: jaxport compile (s) |"
    assert ratios[2:] == [
        "| judged |  | **2.00** | 4.5 |",
        "| compiled in the time |  | **2.00** | in the time |",
        "| stored without either |  | **2.00** | not recorded |",
    ]
