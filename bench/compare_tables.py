"""The speed tables of README.md and docs/performance.md, rendered from the results bench/compare.py stores
(`--results bench/results/<host>.json`), so no figure in them is copied by hand.

    python bench/compare_tables.py           # rewrite every generated block of README.md and docs/performance.md
    python bench/compare_tables.py --check   # exit 1 naming each block that differs from its results file

A generated block sits between `<!-- compare:begin results=FILE[,FILE...] [style=full|ratios] -->` and
`<!-- compare:end -->`: `full` (the default) is compare.py's own table for one results file, headed by the run's
command, host, date and versions; `ratios` is one table of the ratios of several hosts beside each workload's goal.
Both put jaxport's compile time beside every ratio, and `full` the tokens' pass/fail of decoding workloads; a cell
whose stored record holds no such value says "not recorded".
Standard library only, as compare.py."""

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/performance.md")
BLOCK = re.compile(r"(<!-- compare:begin (?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- compare:end -->)", re.DOTALL)
# the ratio each CPU workload is held to (above 1: jaxport faster), by the start of its label
GOALS = {
    "trm_step": 1.0,
    "gpt_step cpu_readme": 1.1,
    "gpt_step shakespeare": 1.0,
    "gpt_run": 1.2,
    "trm_loop": 1.5,
    "dream": 2.5,
}


def goal(workload: str) -> str:
    return next((f"{value:.1f}" for prefix, value in GOALS.items() if workload.startswith(prefix)), "")


def load(path: str | Path) -> dict:
    return json.loads((REPO / path).read_text())


def run_line(results: dict) -> str:
    """One line: the command, the host, when, and the versions of both sides."""
    versions = ", ".join(f"{name} {version}" for name, version in results.get("versions", {}).items())
    return (
        f"`{results['command']}` on {results['host']}, {results['date']}, {results['utc']} UTC"
        + (f", {versions}" if versions else "")
        + "; ratio = original time / jaxport time (above 1: jaxport is faster)."
    )


def compile_cell(record: dict) -> str:
    """jaxport's compile time beside a ratio: seconds, or where the timed run includes compiling (None), or that the
    stored record has none."""
    if "jaxport_compile_s" not in record:
        return "not recorded"
    seconds = record["jaxport_compile_s"]
    return "in the time" if seconds is None else f"{seconds}"


def tokens_cell(record: dict) -> str:
    """The pass/fail of a decoding workload's tokens (compare.py's `fastdllm_verdict`), or that none is stored."""
    verdict = record.get("tokens")
    if verdict is None:
        return "not recorded"
    return f"{verdict['rows_equal']} equal, {'pass' if verdict['passed'] else 'FAIL'}"


def markdown_table(records: list[dict]) -> str:
    """compare.py's table: both times, the ratio with jaxport's compilation beside it, and both peak RSS; decoding
    workloads that report tokens/s and token equality (fastdllm) add them and the tokens' pass/fail."""
    tokens = any("rows_equal" in r or "jaxport_new_tokens_per_s" in r or "tokens" in r for r in records)
    head = ["workload", "original (s)", "jaxport (s)", "ratio", "jaxport compile (s)"]
    head += ["new tokens/s, original → jaxport", "rows equal to the original's"] if tokens else []
    head += ["tokens against the original's batch 1"] if tokens else []
    head += ["peak RSS orig / jaxport (MB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [r["workload"], f"{r['original_s']:.4g}", f"{r['jaxport_s']:.4g}", f"**{r['ratio']:.2f}**"]
        cells.append(compile_cell(r))
        if tokens:
            speeds = (r.get("original_new_tokens_per_s"), r.get("jaxport_new_tokens_per_s"))
            cells += [f"{speeds[0]:,} → {speeds[1]:,}" if None not in speeds else "", r.get("rows_equal", "")]
            cells.append(tokens_cell(r))
        cells.append(f"{r['original_peak_rss'] / 2**20:.0f} / {r['jaxport_peak_rss'] / 2**20:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios_table(runs: list[dict]) -> str:
    """One row per workload: its goal and each host's ratio with jaxport's compile time beside it, the host named
    by the results' `short` name."""
    head = ["workload", "goal"]
    for results in runs:
        head += [results["short"], f"{results['short']}: jaxport compile (s)"]
    by_host = [{r["workload"]: r for r in results["records"]} for results in runs]
    workloads = list(dict.fromkeys(w for records in by_host for w in records))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        cells = []
        for records in by_host:
            cells += [f"**{records[w]['ratio']:.2f}**", compile_cell(records[w])] if w in records else ["", ""]
        lines.append("| " + " | ".join([w, goal(w), *cells]) + " |")
    return "\n".join(lines)


def render(args: str) -> str:
    """The body of one generated block, from its marker's arguments."""
    options = dict(item.split("=", 1) for item in args.split())
    runs = [load(path) for path in options["results"].split(",")]
    if options.get("style", "full") == "ratios":
        hosts = "; ".join(f"{r['short']}: {r['host']}, {r['date']}, `{r['command']}`" for r in runs)
        return f"{hosts}.\n\n{ratios_table(runs)}\n"
    if len(runs) != 1:
        raise ValueError(f"style=full takes one results file, not {options['results']}")
    return f"{run_line(runs[0])}\n\n{markdown_table(runs[0]['records'])}\n"


def refreshed(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("args")) + m.group(4), text)


def stale_blocks(text: str) -> list[str]:
    return [m.group("args") for m in BLOCK.finditer(text) if m.group("body") != render(m.group("args"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args()
    stale = []
    for name in DOCUMENTS:
        path = REPO / name
        text = path.read_text()
        if args.check:
            stale += [f"{name}: {block}" for block in stale_blocks(text)]
        elif refreshed(text) != text:
            path.write_text(refreshed(text))
            print(f"rewrote the generated tables of {name}")
    for block in stale:
        print(f"stale: {block} (run python bench/compare_tables.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
