"""The `--compile-for` reports of docs/tpu.md: the users' configurations compiled for TPU slices on this machine.

    python tools/tpu_reports.py [--only trm,gpt,dream] [--out tpu_reports.md] [--doc docs/tpu.md]

Needs libtpu (`pip install 'jaxport[tpu]'`); reads no weights and no data. It writes what the commands need
beside them in a scratch folder: the TRM datasets' `train/dataset.json` (the paper's Sudoku-Extreme and ARC-AGI-1
sizes) and a Dream-v0-Instruct-7B folder holding only its config.json and the Qwen2 tokenizer files of
tests/fixtures. Each command runs in its own process; the Markdown gets the command and its report (a command
whose program does not fit exits with `DOES_NOT_FIT` after its report). With `--doc`, the slice and chip tables and
the reports replace what stands between that file's `<!-- generated: NAME -->` and `<!-- end: NAME -->` markers;
with `--titles` or `--only`, the reports run replace theirs there and the others stay.
"""

import argparse
import gzip
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN2 = REPO / "tests" / "fixtures" / "dream" / "qwen2_tokenizer"
DATASETS = {  # dataset.json of the training split, as the upstream builders write them
    "sudoku-extreme-1k-aug-1000": dict(vocab_size=11, seq_len=81, num_puzzle_identifiers=1, total_groups=1000),
    # 960 tasks (ARC-AGI-1 training and evaluation, ConceptARC) x 1001 versions: the upper bound of the builder's count
    "arc1concept-aug-1000": dict(vocab_size=12, seq_len=900, num_puzzle_identifiers=960961, total_groups=960),
}
SUDOKU = [
    "arch=trm", "data_paths=[data/sudoku-extreme-1k-aug-1000]", "evaluators=[]", "epochs=50000", "eval_interval=5000",
    "lr=1e-4", "puzzle_emb_lr=1e-4", "weight_decay=1.0", "puzzle_emb_weight_decay=1.0",
]  # fmt: skip
TRM = {
    "Sudoku-Extreme, mlp_t": [*SUDOKU, "arch.mlp_t=True", "arch.pos_encodings=none", "arch.L_layers=2",
                              "arch.H_cycles=3", "arch.L_cycles=6", "+run_name=pretrain_mlp_t_sudoku", "ema=True"],
    "Sudoku-Extreme, attention": [*SUDOKU, "arch.L_layers=2", "arch.H_cycles=3", "arch.L_cycles=6",
                                  "+run_name=pretrain_att_sudoku", "ema=True"],
    "ARC-AGI-1": ["arch=trm", "data_paths=[data/arc1concept-aug-1000]", "arch.L_layers=2", "arch.H_cycles=3",
                  "arch.L_cycles=4", "+run_name=pretrain_att_arc1concept_4", "ema=True"],
}  # fmt: skip
GPT_XL = ["--n_layer=48", "--n_head=25", "--n_embd=1600"]  # GPT-2 1.5B's sizes, trained from scratch


def commands(only: set[str]) -> list[tuple[str, list[str]]]:
    """(title, argv after `jaxport`) of every report."""
    runs = []
    if "trm" in only:
        for name, overrides in TRM.items():
            for tpu in ("v4-8", "v4-64"):
                runs.append((f"TRM {name}, {tpu}", ["trm", "train", *overrides, "--compile-for", tpu]))
    if "gpt" in only:
        for size, flags in (("124M", []), ("1.5B", GPT_XL)):
            for tpu, accum, devices in (("v5e-8", 40, 8), ("v5p-64", 64, 32)):
                for fsdp in (1, devices):
                    extra = [] if accum == 40 else [f"--gradient_accumulation_steps={accum}"]
                    argv = ["gpt", "train", "train_gpt2", *flags, *extra, f"--fsdp={fsdp}", "--compile-for", tpu]
                    runs.append((f"GPT-2 {size}, {tpu}, --fsdp={fsdp}", argv))
        for remat in ("block", "save_dots"):  # GPT-2 1.5B's block computed again, whole or but its products
            argv = ["gpt", "train", "train_gpt2", *GPT_XL, "--fsdp=8", "--runtime", f"remat={remat}"]
            runs.append((f"GPT-2 1.5B, v5e-8, --fsdp=8, remat={remat}", [*argv, "--compile-for", "v5e-8"]))
    if "dream" in only:
        chat = ["--prompt", "Write a Python function that checks whether a number is prime.", "--chat"]
        for tpu in ("v2-8", "v3-8", "v5e-8"):
            for batch in (1, 32):
                meshes = [None, "1,1,8"] if batch == 1 else ["1,1,8"]
                for mesh in meshes:
                    argv = ["dream", "generate", "--model", "Dream-v0-Instruct-7B", *chat, "--batch-size", str(batch)]
                    argv += (["--mesh", mesh] if mesh else []) + ["--compile-for", tpu]
                    runs.append(
                        (f"Dream-7B generation, batch {batch}, {tpu}" + (f", --mesh {mesh}" if mesh else ""), argv)
                    )
        for mesh in (None, "1,32,1"):
            argv = ["dream", "train", "--model", "Dream-v0-Instruct-7B", "--data", "sft.jsonl", "--chat"]
            argv += ["--seq-len", "1024", "--batch-size", "32"] + (["--mesh", mesh] if mesh else [])
            runs.append(
                (
                    "Dream-7B fine-tuning, v5p-64" + (f", --mesh {mesh}" if mesh else ""),
                    [*argv, "--compile-for", "v5p-64"],
                )
            )
    return runs


def inputs(folder: Path) -> None:
    """The metadata and config the commands read, nothing more."""
    for name, sizes in DATASETS.items():
        split = folder / "data" / name / "train"
        split.mkdir(parents=True, exist_ok=True)
        meta = dict(pad_id=0, ignore_label_id=0, blank_identifier_id=0, **sizes)
        meta.update(mean_puzzle_examples=1.0, total_puzzles=sizes["total_groups"], sets=["all"])
        (split / "dataset.json").write_text(json.dumps(meta))
    dream = folder / "Dream-v0-Instruct-7B"
    dream.mkdir(exist_ok=True)
    for f in QWEN2.iterdir():  # config.json there is Dream-v0-Instruct-7B's
        if f.name == "vocab.json.gz":
            (dream / "vocab.json").write_bytes(gzip.decompress(f.read_bytes()))
        elif f.name != "expected_ids.json":
            shutil.copy(f, dream / f.name)


def reports_of(doc: Path) -> dict[str, str]:
    """The reports of `doc`'s generated reports section, by title."""
    found = re.search(r"<!-- generated: reports -->\n(.*?)<!-- end: reports -->", doc.read_text(), re.S)
    parts = re.split(r"(?m)^(?=### )", found.group(1)) if found else []
    return {part.splitlines()[0][4:]: part.strip() for part in parts if part.startswith("### ")}


def fill(doc: Path, sections: dict[str, str]) -> None:
    """Replace each generated section of `doc` (between its markers) with its new text."""
    text = doc.read_text()
    for name, body in sections.items():
        marker = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end: {name} -->)", re.S)
        if not marker.search(text):
            sys.exit(f"{doc}: no <!-- generated: {name} --> ... <!-- end: {name} --> markers")
        text = marker.sub(lambda m, body=body: m.group(1) + body.strip() + "\n" + m.group(2), text)
    doc.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="trm,gpt,dream")
    parser.add_argument("--out", default="tpu_reports.md")
    parser.add_argument("--doc", default=None, help="a Markdown file whose generated sections to fill (docs/tpu.md)")
    parser.add_argument("--titles", default=None, help="only the reports whose titles hold one of these (a;b;...)")
    args = parser.parse_args()
    from jaxport.runtime.compile_for import DOES_NOT_FIT

    out = Path(args.out).resolve()
    reports = {}  # title -> its Markdown
    with tempfile.TemporaryDirectory(prefix="jaxport_tpu_reports_") as tmp:
        inputs(Path(tmp))
        for title, argv in commands(set(args.only.split(","))):
            if args.titles and not any(t in title for t in args.titles.split(";")):
                continue
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "jaxport.cli", *argv], capture_output=True, text=True, cwd=tmp)
            reported = proc.returncode in (0, DOES_NOT_FIT)
            text = proc.stdout.strip() if reported else (proc.stdout + proc.stderr).strip()[-3000:]
            shown = " ".join(a if " " not in a and "[" not in a else repr(a) for a in argv)
            reports[title] = "\n".join([f"### {title}", "", "```", f"$ jaxport {shown}", text, "```"])
            print(f"{title}: exit {proc.returncode}, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            out.write_text("\n\n".join(reports.values()) + "\n")
    if args.doc:
        from jaxport.runtime.topologies import chip_table, slice_table

        kept = reports_of(Path(args.doc))
        every = [title for title, _ in commands({"trm", "gpt", "dream"})]
        body = "\n\n".join(reports.get(title) or kept[title] for title in every if title in reports or title in kept)
        fill(Path(args.doc), {"slices": slice_table(), "chips": chip_table(), "reports": body + "\n"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
