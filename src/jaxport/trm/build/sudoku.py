"""`jaxport trm build sudoku`: Sudoku datasets as upstream's dataset/build_sudoku_dataset.py.

Source: `train.csv` and `test.csv` in the Sudoku-Extreme format (`source,question,answer,rating`,
81 characters per grid, `.` for a blank), downloaded from the Hugging Face dataset
`--source-repo` (upstream's default sapientinc/sudoku-extreme) or read from `--source-dir`;
or `--generate`, which makes valid puzzles with unique solutions and a chosen number of givens,
offline.

Tokens: PAD 0, blank 1, digits 1..9 -> 2..10 (vocab 11), seq_len 81; labels are the full
solution. Each training puzzle and its `--num-aug` shuffles (digit permutation, optional
transpose, band/row and stack/column permutations) form one group; the test split is never
augmented.
"""

import argparse
from pathlib import Path

import numpy as np

from jaxport.errors import JaxportError
from jaxport.trm.build.common import (
    add_source_arguments,
    read_puzzle_csv,
    single_example_arrays,
    source_csv_paths,
    write_identifiers,
    write_split,
)
from jaxport.trm.data import PuzzleDatasetMetadata


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxport trm build sudoku",
        add_help=add_help,
        description="Build a Sudoku dataset in upstream TRM's format.",
    )
    p.add_argument("--output-dir", default="data/sudoku-extreme-full", help="dataset folder to write")
    src = add_source_arguments(p, "sapientinc/sudoku-extreme")
    src.add_argument("--generate", action="store_true", help="generate puzzles instead of reading CSVs")
    p.add_argument("--subsample-size", type=int, default=None, help="keep this many random training puzzles")
    p.add_argument("--min-difficulty", type=int, default=None, help="keep puzzles with rating >= this")
    p.add_argument("--num-aug", type=int, default=0, help="shuffled copies per training puzzle")
    p.add_argument("--num-train", type=int, default=1000, help="--generate: training puzzles")
    p.add_argument("--num-test", type=int, default=200, help="--generate: test puzzles")
    p.add_argument("--givens", type=int, default=30, help="--generate: filled cells per puzzle (17..80)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="numpy seed (upstream leaves numpy unseeded; np.random.seed(S) there equals --seed S)",
    )
    return p


def shuffle_sudoku(board: np.ndarray, solution: np.ndarray, rng: np.random.RandomState):
    """One validity-preserving shuffle applied identically to a puzzle and its solution."""
    digit_map = np.pad(rng.permutation(np.arange(1, 10)), (1, 0))  # blank (0) stays 0
    transpose = rng.rand() < 0.5
    bands = rng.permutation(3)
    row_perm = np.concatenate([b * 3 + rng.permutation(3) for b in bands])
    stacks = rng.permutation(3)
    col_perm = np.concatenate([s * 3 + rng.permutation(3) for s in stacks])
    # new cell (r, c) takes old cell (row_perm[r], col_perm[c])
    mapping = (row_perm[:, None] * 9 + col_perm[None, :]).reshape(-1)

    def apply(x):
        if transpose:
            x = x.T
        return digit_map[x.flatten()[mapping].reshape(9, 9)]

    return apply(board), apply(solution)


def _grid(text: str, where: str, blank_ok: bool) -> np.ndarray:
    if len(text) != 81:
        raise JaxportError(f"{where}: a Sudoku grid needs 81 characters, got {len(text)}")
    allowed = set(".0123456789") if blank_ok else set("123456789")
    if set(text) - allowed:
        raise JaxportError(f"{where}: unexpected characters {sorted(set(text) - allowed)} in a Sudoku grid")
    return np.frombuffer(text.replace(".", "0").encode(), dtype=np.uint8).reshape(9, 9) - ord("0")


def convert_subset(
    rows,
    set_name: str,
    output_dir: Path,
    *,
    subsample_size,
    min_difficulty,
    num_aug: int,
    rng: np.random.RandomState,
    where: str,
) -> None:
    inputs, labels = [], []
    for i, (_source, question, answer, rating) in enumerate(rows):
        if min_difficulty is not None and not rating.strip().lstrip("-").isdigit():
            raise JaxportError(f"{where} row {i + 2}: rating {rating!r} is not an integer (needed by --min-difficulty)")
        if min_difficulty is None or int(rating) >= min_difficulty:
            inputs.append(_grid(question, f"{where} row {i + 2} question", True))
            labels.append(_grid(answer, f"{where} row {i + 2} answer", False))
    if not inputs:
        raise JaxportError(f"{where}: no puzzles left to build the {set_name} split from")

    if set_name == "train" and subsample_size is not None and subsample_size < len(inputs):
        chosen = rng.choice(len(inputs), size=subsample_size, replace=False)
        inputs = [inputs[i] for i in chosen]
        labels = [labels[i] for i in chosen]

    num_aug = num_aug if set_name == "train" else 0
    all_inputs, all_labels = [], []
    for board, solution in zip(inputs, labels):
        all_inputs.append(board)
        all_labels.append(solution)
        for _ in range(num_aug):
            board_aug, solution_aug = shuffle_sudoku(board, solution, rng)
            all_inputs.append(board_aug)
            all_labels.append(solution_aug)

    # Upstream's dtypes: uint8 without augmentation, int64 once shuffled grids are mixed in.
    def to_tokens(grids):
        return np.concatenate(grids).reshape(len(grids), -1) + 1

    arrays = single_example_arrays(to_tokens(all_inputs), to_tokens(all_labels), [1 + num_aug] * len(inputs))
    groups = len(inputs)
    metadata = PuzzleDatasetMetadata(
        pad_id=0,
        ignore_label_id=0,
        blank_identifier_id=0,
        vocab_size=11,
        seq_len=81,
        num_puzzle_identifiers=1,
        total_groups=groups,
        mean_puzzle_examples=1.0,
        total_puzzles=groups,
        sets=["all"],
    )
    write_split(output_dir, set_name, {"all": arrays}, metadata)
    write_identifiers(output_dir, ["<blank>"])


# ----- built-in generator

_ALL = 0x3FE  # bits 1..9
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]


class _Board:
    """Row/column/box digit masks over a flat grid, for a small backtracking solver."""

    def __init__(self, cells):
        self.cells = list(cells)
        self.rows, self.cols, self.boxes = [0] * 9, [0] * 9, [0] * 9
        self.valid = True
        for i, v in enumerate(self.cells):
            if v:
                bit = 1 << v
                r, c, b = i // 9, i % 9, _BOX[i]
                if (self.rows[r] | self.cols[c] | self.boxes[b]) & bit:
                    self.valid = False
                self._set(i, v)

    def _set(self, i, v):
        bit = 1 << v
        self.cells[i] = v
        self.rows[i // 9] |= bit
        self.cols[i % 9] |= bit
        self.boxes[_BOX[i]] |= bit

    def _unset(self, i, v):
        bit = ~(1 << v)
        self.cells[i] = 0
        self.rows[i // 9] &= bit
        self.cols[i % 9] &= bit
        self.boxes[_BOX[i]] &= bit

    def _most_constrained(self):
        best, best_mask, best_n = -1, 0, 10
        for i in range(81):
            if self.cells[i] == 0:
                mask = _ALL & ~(self.rows[i // 9] | self.cols[i % 9] | self.boxes[_BOX[i]])
                n = bin(mask).count("1")
                if n < best_n:
                    best, best_mask, best_n = i, mask, n
                    if n <= 1:
                        break
        return best, best_mask

    def count_solutions(self, limit: int = 2) -> int:
        if not self.valid:
            return 0
        i, mask = self._most_constrained()
        if i < 0:
            return 1
        total = 0
        for v in range(1, 10):
            if mask & (1 << v):
                self._set(i, v)
                total += self.count_solutions(limit - total)
                self._unset(i, v)
                if total >= limit:
                    break
        return total

    def fill_randomly(self, rng: np.random.RandomState) -> bool:
        i, mask = self._most_constrained()
        if i < 0:
            return True
        for v in rng.permutation(np.arange(1, 10)):
            v = int(v)
            if mask & (1 << v):
                self._set(i, v)
                if self.fill_randomly(rng):
                    return True
                self._unset(i, v)
        return False


def generate_puzzle(givens: int, rng: np.random.RandomState, max_attempts: int = 200) -> tuple[str, str]:
    """A random solved grid, then cells blanked in random order while the solution stays unique,
    until `givens` cells are left. Returns (question with '.', answer) as 81-char strings."""
    if not 17 <= givens <= 81:
        raise JaxportError(f"--givens must be between 17 and 81 (a Sudoku needs at least 17 clues), got {givens}")
    for _ in range(max_attempts):
        board = _Board([0] * 81)
        board.fill_randomly(rng)
        solution = list(board.cells)
        puzzle = list(solution)
        filled = 81
        for i in rng.permutation(81):
            if filled == givens:
                break
            kept = puzzle[i]
            puzzle[i] = 0
            if _Board(puzzle).count_solutions(2) == 1:
                filled -= 1
            else:
                puzzle[i] = kept
        if filled == givens:
            return "".join(str(v) if v else "." for v in puzzle), "".join(map(str, solution))
    raise JaxportError(
        f"could not reach {givens} givens with a unique solution in {max_attempts} attempts; "
        f"use more givens (25 or more is quick)"
    )


def generate_rows(count: int, givens: int, rng: np.random.RandomState, seen: set) -> list[tuple[str, str, str, str]]:
    rows = []
    while len(rows) < count:
        question, answer = generate_puzzle(givens, rng)
        if question not in seen:
            seen.add(question)
            rows.append(("jaxport-generated", question, answer, "0"))
    return rows


def build_sudoku(args: argparse.Namespace) -> Path:
    output_dir = Path(args.output_dir)
    rng = np.random.RandomState(args.seed)
    options = dict(
        subsample_size=args.subsample_size, min_difficulty=args.min_difficulty, num_aug=args.num_aug, rng=rng
    )
    if args.generate:
        seen: set = set()
        train_rows = generate_rows(args.num_train, args.givens, rng, seen)
        test_rows = generate_rows(args.num_test, args.givens, rng, seen)
        convert_subset(train_rows, "train", output_dir, where="generated train puzzles", **options)
        convert_subset(test_rows, "test", output_dir, where="generated test puzzles", **options)
    else:
        for set_name, csv_path in source_csv_paths(args.source_dir, args.source_repo).items():
            convert_subset(read_puzzle_csv(csv_path), set_name, output_dir, where=str(csv_path), **options)
    return output_dir


def main(argv=None) -> int:
    out = build_sudoku(parser().parse_args(argv))
    print(f"wrote {out}")
    return 0
