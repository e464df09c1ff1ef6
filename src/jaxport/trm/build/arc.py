"""`jaxport trm build arc`: ARC-AGI datasets as upstream's dataset/build_arc_dataset.py.

Source: kaggle-format files `<prefix>_<subset>_challenges.json` (and `_solutions.json`
when the test outputs are known) for every subset in `--subsets`. Every puzzle's "train"
examples go to the train split; its "test" examples go to the test split if the subset is
`--test-set-name` (or `--test-set-name2`) and to the train split otherwise.

Each puzzle gets up to `--num-aug` distinct augmented versions (a dihedral transform and a
permutation of colours 1..9), each its own puzzle identifier `name|||t<k>|||<perm>`; a puzzle
and its versions form a group. Grids are placed on a 30x30 canvas: PAD 0, EOS 1 (a row
under and a column right of the grid), colours 0..9 -> 2..11. In the train split every
example but one per puzzle is translated to a random offset. `test_puzzles.json` keeps the
test puzzles (with solutions) for the ARC evaluator.
"""

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from jaxport.errors import JaxportError
from jaxport.trm.build.common import dihedral_transform, inverse_dihedral_transform, write_identifiers, write_split
from jaxport.trm.data import PuzzleDatasetMetadata

GRID = 30
AUGMENT_RETRIES_FACTOR = 5
SEPARATOR = "|||"


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxport trm build arc", add_help=add_help, description="Build an ARC dataset in upstream TRM's format."
    )
    p.add_argument(
        "--input-file-prefix",
        required=True,
        help="path prefix of the kaggle files, e.g. data/arc-agi (reads <prefix>_<subset>_challenges.json)",
    )
    p.add_argument("--output-dir", required=True, help="dataset folder to write")
    p.add_argument("--subsets", nargs="+", required=True, help="subset names, e.g. training evaluation concept")
    p.add_argument("--test-set-name", required=True, help="subset whose test examples form the test split")
    p.add_argument("--test-set-name2", default="evaluation2", help="a second such subset")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--num-aug", type=int, default=1000, help="augmented versions per puzzle")
    p.add_argument(
        "--puzzle-identifiers-start",
        type=int,
        default=1,
        help="first puzzle identifier (0 is blank); raise it to combine datasets",
    )
    return p


@dataclasses.dataclass
class Puzzle:
    id: str
    examples: list  # [(input grid, output grid)] as uint8 arrays


def arc_grid_to_np(grid, where: str = "grid") -> np.ndarray:
    try:
        arr = np.array(grid)
    except ValueError:
        raise JaxportError(f"{where}: not a rectangular grid") from None
    if arr.ndim != 2 or arr.shape[0] > GRID or arr.shape[1] > GRID or not np.all((arr >= 0) & (arr <= 9)):
        raise JaxportError(
            f"{where}: an ARC grid must be 2-D, at most {GRID}x{GRID}, with colours 0..9 (got shape {arr.shape})"
        )
    return arr.astype(np.uint8)


def grid_hash(grid: np.ndarray) -> str:
    data = bytes(grid.shape) + grid.astype(np.uint8, copy=False).tobytes()
    return hashlib.sha256(data).hexdigest()


def puzzle_hash(versions: dict) -> str:
    """Order-independent hash of all example pairs of one puzzle version (over both splits)."""
    pairs = sorted(f"{grid_hash(i)}|{grid_hash(o)}" for p in versions.values() for i, o in p.examples)
    return hashlib.sha256("|".join(pairs).encode()).hexdigest()


def augment(name: str, rng: np.random.RandomState):
    trans_id = rng.randint(0, 8)
    colours = np.concatenate([np.arange(0, 1, dtype=np.uint8), rng.permutation(np.arange(1, 10, dtype=np.uint8))])
    aug_name = f"{name}{SEPARATOR}t{trans_id}{SEPARATOR}{''.join(str(x) for x in colours)}"
    return aug_name, lambda grid: dihedral_transform(colours[grid], trans_id)


def inverse_augment(name: str):
    """(original name, function mapping a grid of the augmented puzzle back to the original)."""
    if SEPARATOR not in name:
        return name, lambda grid: grid
    trans, perm = name.split(SEPARATOR)[-2:]
    trans_id = int(trans[1:])
    inverse_colours = np.argsort(list(perm)).astype(np.uint8)
    return name.split(SEPARATOR)[0], lambda grid: inverse_colours[inverse_dihedral_transform(grid, trans_id)]


def to_canvas(inp: np.ndarray, out: np.ndarray, translate: bool, rng: np.random.RandomState):
    """Both grids on the 30x30 canvas at the same (random or zero) top-left offset."""
    if translate:
        top = rng.randint(0, GRID - max(inp.shape[0], out.shape[0]) + 1)
        left = rng.randint(0, GRID - max(inp.shape[1], out.shape[1]) + 1)
    else:
        top = left = 0
    seqs = []
    for grid in (inp, out):
        rows, cols = grid.shape
        canvas = np.pad(grid + 2, ((top, GRID - top - rows), (left, GRID - left - cols)), constant_values=0)
        if top + rows < GRID:
            canvas[top + rows, left : left + cols] = 1
        if left + cols < GRID:
            canvas[top : top + rows, left + cols] = 1
        seqs.append(canvas.flatten())
    return seqs


def convert_puzzle(results: dict, name: str, puzzle: dict, num_aug: int, dest_of: dict, rng) -> None:
    """Append a group (the puzzle and its augmented versions) to every split it feeds."""
    dests = sorted(set(dest_of.values()))
    original = {dest: Puzzle(name, []) for dest in dests}
    for example_type, examples in puzzle.items():
        if example_type not in dest_of:
            continue
        where = f"puzzle {name} {example_type}"
        original[dest_of[example_type]].examples.extend(
            (arc_grid_to_np(e["input"], where), arc_grid_to_np(e["output"], where)) for e in examples
        )

    group = [original]
    if num_aug > 0:
        seen = {puzzle_hash(original)}
        for _ in range(AUGMENT_RETRIES_FACTOR * num_aug):
            aug_name, map_grid = augment(name, rng)
            version = {
                d: Puzzle(aug_name, [(map_grid(i), map_grid(o)) for i, o in p.examples]) for d, p in original.items()
            }
            h = puzzle_hash(version)
            if h not in seen:
                seen.add(h)
                group.append(version)
            if len(group) >= num_aug + 1:
                break
        if len(group) < num_aug + 1:
            print(f"[puzzle {name}] only {len(group) - 1} distinct augmentations")

    for dest in dests:
        split, set_name = dest
        results.setdefault(split, {}).setdefault(set_name, []).append([version[dest] for version in group])


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise JaxportError(f"ARC file not found: {path}") from None
    except json.JSONDecodeError as err:
        raise JaxportError(f"ARC file is not valid JSON: {path} ({err})") from None


def load_puzzles(args, rng):
    test_subsets = {args.test_set_name, args.test_set_name2}
    results = {"train": {}}  # the train split comes first, as in upstream's runs
    test_puzzles = {}
    for subset in args.subsets:
        challenges_path = Path(f"{args.input_file_prefix}_{subset}_challenges.json")
        puzzles = _read_json(challenges_path)
        solutions_path = Path(f"{args.input_file_prefix}_{subset}_solutions.json")
        if solutions_path.is_file():
            solutions = _read_json(solutions_path)
            for puzzle_id, puzzle in puzzles.items():
                if puzzle_id not in solutions:
                    raise JaxportError(f"{solutions_path} has no solutions for puzzle {puzzle_id}")
                for idx, grid in enumerate(solutions[puzzle_id]):
                    puzzle["test"][idx]["output"] = grid
        else:
            print(f"{subset} solutions not found, filling with dummy")
            for puzzle in puzzles.values():
                for example in puzzle["test"]:
                    example.setdefault("output", [[0]])

        puzzles = list(puzzles.items())
        rng.shuffle(puzzles)
        test_dest = ("test", "all") if subset in test_subsets else ("train", "all")
        for name, puzzle in puzzles:
            if test_dest[0] == "test":
                test_puzzles[name] = puzzle
            convert_puzzle(results, name, puzzle, args.num_aug, {"train": ("train", "all"), "test": test_dest}, rng)
    return results, test_puzzles


def build_arc(args: argparse.Namespace) -> Path:
    output_dir = Path(args.output_dir)
    rng = np.random.RandomState(args.seed)
    data, test_puzzles = load_puzzles(args, rng)

    identifier_of = {}
    next_id = args.puzzle_identifiers_start  # 0 is <blank>
    for split in data.values():
        for groups in split.values():
            for group in groups:
                for puzzle in group:
                    if puzzle.id not in identifier_of:
                        identifier_of[puzzle.id] = next_id
                        next_id += 1

    for split_name, split in data.items():
        translate = split_name == "train"
        total_examples = total_puzzles = total_groups = 0
        arrays_by_set = {}
        for set_name, groups in split.items():
            inputs, labels, identifiers, puzzle_indices, group_indices = [], [], [], [0], [0]
            for group in groups:
                for puzzle in group:
                    untranslated = rng.randint(0, len(puzzle.examples))  # one example per puzzle stays in place
                    for idx, (inp, out) in enumerate(puzzle.examples):
                        inp_seq, out_seq = to_canvas(inp, out, translate and idx != untranslated, rng)
                        inputs.append(inp_seq)
                        labels.append(out_seq)
                    puzzle_indices.append(len(inputs))
                    identifiers.append(identifier_of[puzzle.id])
                    total_puzzles += 1
                group_indices.append(len(identifiers))
                total_groups += 1
            total_examples += len(inputs)
            arrays_by_set[set_name] = {
                "inputs": np.stack(inputs, 0),
                "labels": np.stack(labels, 0),
                "puzzle_identifiers": np.array(identifiers, dtype=np.int32),
                "puzzle_indices": np.array(puzzle_indices, dtype=np.int32),
                "group_indices": np.array(group_indices, dtype=np.int32),
            }
        metadata = PuzzleDatasetMetadata(
            pad_id=0,
            ignore_label_id=0,
            blank_identifier_id=0,
            vocab_size=12,
            seq_len=GRID * GRID,
            num_puzzle_identifiers=next_id,
            total_groups=total_groups,
            mean_puzzle_examples=total_examples / total_puzzles,
            total_puzzles=total_puzzles,
            sets=list(split.keys()),
        )
        write_split(output_dir, split_name, arrays_by_set, metadata)

    names = {v: k for k, v in identifier_of.items()}
    write_identifiers(output_dir, [names.get(i, "<blank>") for i in range(next_id)])
    (output_dir / "test_puzzles.json").write_text(json.dumps(test_puzzles))
    return output_dir


def main(argv=None) -> int:
    out = build_arc(parser().parse_args(argv))
    print(f"wrote {out}")
    return 0
