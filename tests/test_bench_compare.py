"""bench/compare.py's pass/fail of the Fast-dLLM comparison, without models: the decision on the tokens
(`fastdllm_verdict`) and `main`'s exit status with it."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
NEAR_TIE = 1e-5
PROMPT = [7, 8, 9]


@pytest.fixture
def compare(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # compare.py imports its neighbour host.py
    spec = importlib.util.spec_from_file_location("compare", BENCH / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(count: int) -> list[list[int]]:
    return [PROMPT + [row, row + 1, row + 2, row + 3] for row in range(count)]


def changed(tokens: list[list[int]], row: int, position: int) -> list[list[int]]:
    """`tokens` with new token `position` of `row` replaced."""
    out = [list(r) for r in tokens]
    out[row][len(PROMPT) + position] = 99
    return out


def margins(count: int, row: int | None = None, by_position=None) -> list[list]:
    """Clear margins for every row, `row` given `by_position`."""
    out = [[None, 0.5, 0.5, 0.5] for _ in range(count)]
    if row is not None:
        out[row] = by_position
    return out


NEAR = [None, 0.5, 3e-6, 3e-6]  # a near-tie before the third new token was decided
AFTER = [None, 0.5, 0.5, 0.0]  # an exact tie, but only before the fourth


@pytest.mark.parametrize(
    "rows_in_all, ours, by_position, equal, near, other, passed",
    [
        (8, lambda t: t, None, "8/8", [], [], True),
        # one row in 8 whose first difference follows a near-tie: Fast-dLLM's order may differ by rounding alone
        (8, lambda t: changed(t, 5, 2), (5, NEAR), "7/8", [5], [], True),
        (8, lambda t: changed(changed(t, 5, 3), 5, 2), (5, NEAR), "7/8", [5], [], True),
        # a difference before any near-tie
        (8, lambda t: changed(t, 5, 1), (5, NEAR), "7/8", [], [5], False),
        (8, lambda t: changed(t, 5, 2), (5, AFTER), "7/8", [], [5], False),
        (8, lambda t: changed(t, 5, 0), (5, NEAR), "7/8", [], [5], False),  # no choice before the first token
        # near-ties in more than one row in 8
        (8, lambda t: changed(changed(t, 5, 2), 6, 2), None, "6/8", [5, 6], [], False),
        (4, lambda t: changed(t, 1, 2), (1, NEAR), "3/4", [1], [], False),
        (16, lambda t: changed(changed(t, 5, 2), 6, 2), None, "14/16", [5, 6], [], True),
        # a different prompt is never a near-tie
        (8, lambda t: [[0, *t[0][1:]], *t[1:]], None, "7/8", [], [0], False),
    ],
)
def test_the_tokens_verdict(compare, rows_in_all, ours, by_position, equal, near, other, passed):
    theirs = rows(rows_in_all)
    given = margins(rows_in_all, *(by_position or ()))
    if by_position is None:  # every row with a near-tie before its third token
        given = [NEAR] * rows_in_all
    verdict = compare.fastdllm_verdict(theirs, ours(theirs), given, NEAR_TIE)
    assert verdict == {
        "rows_equal": equal,
        "rows_differing_after_a_near_tie": near,
        "rows_differing_otherwise": other,
        "passed": passed,
    }


def test_main_exits_with_the_verdict(compare, monkeypatch, tmp_path, capsys):
    """A forced mismatch fails the command after writing its JSON and Markdown, with compile time beside the ratio."""
    theirs = rows(8)
    workloads = {
        "same": compare.fastdllm_verdict(theirs, theirs, margins(8), NEAR_TIE),
        "forced": compare.fastdllm_verdict(theirs, changed(theirs, 3, 1), margins(8), NEAR_TIE),
    }
    extras = {"original_peak_rss": 2**20, "jaxport_peak_rss": 2**21, "jaxport_compile_s": 4.5}
    for name, verdict in workloads.items():
        row = (f"fastdllm {name}", 2.0, 1.0, {**extras, "tokens": verdict})
        monkeypatch.setitem(compare.WORKLOADS, name, (False, lambda tmp, quick, row=row: [row]))
    for name in compare.REF_ENV:
        monkeypatch.setenv(name, "unused")
    monkeypatch.setattr(compare, "versions", lambda: {"jax": "x", "torch": "y"})  # no originals' Python here
    markdown, results = tmp_path / "compare.md", tmp_path / "results.json"

    def main(only: str) -> int:
        argv = ["compare.py", "--only", only, "--markdown", str(markdown), "--results", str(results)]
        monkeypatch.setattr(sys, "argv", argv)
        return compare.main()

    assert main("same") == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert list(record)[3:5] == ["ratio", "jaxport_compile_s"] and record["jaxport_compile_s"] == 4.5
    assert "| **2.00** | 4.5 |" in markdown.read_text() and "8/8 equal, pass |" in markdown.read_text()
    assert main("same,forced") == 1
    assert "FAILED: fastdllm forced" in capsys.readouterr().err
    assert "7/8 equal, FAIL |" in markdown.read_text()
    # the stored run keeps the verdict, so the tables rendered from it show it too
    assert [r["tokens"]["passed"] for r in json.loads(results.read_text())["records"]] == [True, False]
