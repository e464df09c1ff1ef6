"""`jaxport trm build maze`: maze datasets as upstream's dataset/build_maze_dataset.py.

Source: `train.csv` and `test.csv` (`source,question,answer,rating`, each grid a square of the
characters `# SGo`: wall, open, start, goal, path), downloaded from the Hugging Face dataset
`--source-repo` (upstream's default sapientinc/maze-30x30-hard-1k) or read from `--source-dir`.
Tokens: PAD 0, `# SGo` -> 1..5 (vocab 6);
`--aug` adds the 8 dihedral transforms of every training maze as one group.
"""

import argparse
from pathlib import Path

import numpy as np

from jaxport.errors import JaxportError
from jaxport.trm.build.common import (
    add_source_arguments,
    dihedral_transform,
    read_puzzle_csv,
    single_example_arrays,
    source_csv_paths,
    write_identifiers,
    write_split,
)
from jaxport.trm.data import PuzzleDatasetMetadata

CHARSET = "# SGo"


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxport trm build maze", add_help=add_help, description="Build a maze dataset in upstream TRM's format."
    )
    add_source_arguments(p, "sapientinc/maze-30x30-hard-1k")
    p.add_argument("--output-dir", default="data/maze-30x30-hard-1k", help="dataset folder to write")
    p.add_argument("--subsample-size", type=int, default=None, help="keep this many random training mazes")
    p.add_argument("--aug", action="store_true", help="add the 8 dihedral transforms of each training maze")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="numpy seed (upstream leaves numpy unseeded; np.random.seed(S) there equals --seed S)",
    )
    return p


def convert_subset(
    rows, set_name: str, output_dir: Path, *, subsample_size, aug: bool, rng: np.random.RandomState, where: str
) -> None:
    if not rows:
        raise JaxportError(f"{where}: no mazes in the file")
    side = int(len(rows[0][1]) ** 0.5)
    inputs, labels = [], []
    for i, (_source, question, answer, _rating) in enumerate(rows):
        for name, text in (("question", question), ("answer", answer)):
            if len(text) != side * side:
                raise JaxportError(f"{where} row {i + 2}: {name} has {len(text)} characters, expected {side}x{side}")
            if set(text) - set(CHARSET):
                raise JaxportError(
                    f"{where} row {i + 2}: {name} has characters outside {CHARSET!r}: "
                    f"{sorted(set(text) - set(CHARSET))}"
                )
        inputs.append(np.frombuffer(question.encode(), dtype=np.uint8).reshape(side, side))
        labels.append(np.frombuffer(answer.encode(), dtype=np.uint8).reshape(side, side))

    if set_name == "train" and subsample_size is not None and subsample_size < len(inputs):
        chosen = rng.choice(len(inputs), size=subsample_size, replace=False)
        inputs = [inputs[i] for i in chosen]
        labels = [labels[i] for i in chosen]

    transforms = range(8) if (set_name == "train" and aug) else range(1)
    char_to_id = np.zeros(256, np.uint8)
    char_to_id[np.frombuffer(CHARSET.encode(), np.uint8)] = np.arange(len(CHARSET)) + 1

    def tokens(grids):
        return np.vstack([char_to_id[dihedral_transform(g, t).reshape(-1)] for g in grids for t in transforms])

    arrays = single_example_arrays(tokens(inputs), tokens(labels), [len(transforms)] * len(inputs))
    metadata = PuzzleDatasetMetadata(
        pad_id=0,
        ignore_label_id=0,
        blank_identifier_id=0,
        vocab_size=len(CHARSET) + 1,
        seq_len=side * side,
        num_puzzle_identifiers=1,
        total_groups=len(inputs),
        mean_puzzle_examples=1.0,
        total_puzzles=len(inputs),
        sets=["all"],
    )
    write_split(output_dir, set_name, {"all": arrays}, metadata)
    write_identifiers(output_dir, ["<blank>"])


def build_maze(args: argparse.Namespace) -> Path:
    output_dir = Path(args.output_dir)
    rng = np.random.RandomState(args.seed)
    for set_name, csv_path in source_csv_paths(args.source_dir, args.source_repo).items():
        convert_subset(
            read_puzzle_csv(csv_path),
            set_name,
            output_dir,
            subsample_size=args.subsample_size,
            aug=args.aug,
            rng=rng,
            where=str(csv_path),
        )
    return output_dir


def main(argv=None) -> int:
    out = build_maze(parser().parse_args(argv))
    print(f"wrote {out}")
    return 0
