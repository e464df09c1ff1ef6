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
