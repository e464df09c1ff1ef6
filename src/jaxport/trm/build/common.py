"""What every builder shares: writing a split, the dihedral transforms, reading source CSVs.

Upstream's builders draw from numpy's global legacy RNG; here each build owns a
`np.random.RandomState(seed)`, which is that same generator, and makes the same calls in
the same order, so `--seed S` reproduces upstream run after `np.random.seed(S)`.
"""

import argparse
import csv
import json
from pathlib import Path

import numpy as np

from jaxport.errors import JaxportError, write_error
from jaxport.trm.data import PuzzleDatasetMetadata

# tid -> inverse tid for the 8 dihedral transforms below
DIHEDRAL_INVERSE = [0, 3, 2, 1, 4, 5, 6, 7]


def dihedral_transform(grid: np.ndarray, tid: int) -> np.ndarray:
    """The 8 symmetries of the square: 0 identity, 1-3 rotations by 90/180/270 degrees,
    4 left-right flip, 5 up-down flip, 6 transpose, 7 anti-transpose."""
    if tid == 0:
        return grid
    if tid in (1, 2, 3):
        return np.rot90(grid, k=tid)
    if tid == 4:
        return np.fliplr(grid)
    if tid == 5:
        return np.flipud(grid)
    if tid == 6:
        return grid.T
    if tid == 7:
        return np.fliplr(np.rot90(grid, k=1))
    raise ValueError(f"dihedral transform id must be 0..7, got {tid}")


def inverse_dihedral_transform(grid: np.ndarray, tid: int) -> np.ndarray:
    return dihedral_transform(grid, DIHEDRAL_INVERSE[tid])


def write_split(
    output_dir: Path, split: str, arrays_by_set: dict[str, dict[str, np.ndarray]], metadata: PuzzleDatasetMetadata
) -> None:
    """Write `<output_dir>/<split>/dataset.json` and `<set>__<field>.npy` for every set."""
    split_dir = Path(output_dir) / split
    split_dir.mkdir(parents=True, exist_ok=True)
    (split_dir / "dataset.json").write_text(metadata.to_json())
    for set_name, arrays in arrays_by_set.items():
        for field, array in arrays.items():
            path = split_dir / f"{set_name}__{field}.npy"
            try:
                np.save(path, array)
                if array.size:  # numpy misses some short writes (a full disk): the file must hold the array
                    np.load(path, mmap_mode="r")
            except (OSError, ValueError) as err:
                raise write_error(err, path) from None


def write_identifiers(output_dir: Path, names: list[str]) -> None:
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "identifiers.json").write_text(json.dumps(names))


def single_example_arrays(inputs: np.ndarray, labels: np.ndarray, group_sizes: list[int]) -> dict[str, np.ndarray]:
    """Index arrays for datasets where every example is its own puzzle (identifier 0) and
    `group_sizes` consecutive puzzles form a group (an original and its augmentations)."""
    count = len(inputs)
    return {
        "inputs": inputs,
        "labels": labels,
        "group_indices": np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int32),
        "puzzle_indices": np.arange(count + 1, dtype=np.int32),
        "puzzle_identifiers": np.zeros(count, dtype=np.int32),
    }


def add_source_arguments(parser: argparse.ArgumentParser, default_repo: str):
    """`--source-repo` (upstream's Hugging Face dataset, the default) or `--source-dir`, exclusive;
    returns the group so a builder can add other sources to it."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--source-repo",
        default=default_repo,
        help="Hugging Face dataset to download train.csv and test.csv from (the default source)",
    )
    group.add_argument("--source-dir", help="folder with train.csv and test.csv (source,question,answer,rating)")
    return group


def source_csv_paths(source_dir: str | None, source_repo: str) -> dict[str, Path]:
    """`train.csv` and `test.csv`: from `source_dir` when given, else downloaded from the Hugging Face
    dataset `source_repo` (cached by huggingface_hub), as upstream's builders do."""
    if source_dir is not None:
        source = Path(source_dir)
        if not source.is_dir():
            raise JaxportError(f"--source-dir not found: {source} (expected a folder with train.csv and test.csv)")
        return {name: source / f"{name}.csv" for name in ("train", "test")}
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    paths = {}
    for name in ("train", "test"):
        try:
            paths[name] = Path(hf_hub_download(source_repo, f"{name}.csv", repo_type="dataset"))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
            raise JaxportError(
                f"could not download {name}.csv of the Hugging Face dataset {source_repo} ({e}); "
                "without a network, pass --source-dir with local train.csv and test.csv"
            ) from None
    return paths


def read_puzzle_csv(path: Path) -> list[tuple[str, str, str, str]]:
    """Rows of a `source,question,answer,rating` CSV as the Hugging Face datasets ship them."""
    path = Path(path)
    if not path.is_file():
        raise JaxportError(f"source CSV not found: {path}")
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise JaxportError(f"source CSV is empty: {path}")
        rows = []
        for line_no, row in enumerate(reader, start=2):
            if len(row) != 4:
                raise JaxportError(
                    f"{path}:{line_no}: expected 4 columns (source,question,answer,rating), got {len(row)}"
                )
            rows.append(tuple(row))
    return rows
