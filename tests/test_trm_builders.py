"""The builders reproduce, byte for byte, the folders upstream's builders wrote from the same
sources (tests/fixtures/trm/datasets, case.json "builder_commands"); the offline Sudoku
generator makes valid puzzles with unique solutions."""

import filecmp
from pathlib import Path

import numpy as np
import pytest

from jaxport.errors import JaxportError
from jaxport.trm.build import arc, maze, sudoku
from jaxport.trm.build.common import dihedral_transform, inverse_dihedral_transform
from jaxport.trm.data import PuzzleDataset

ROOT = Path(__file__).parent / "fixtures" / "trm" / "datasets"
SOURCES = ROOT / "sources"


def assert_same_tree(expected: Path, actual: Path):
    files = sorted(p.relative_to(expected) for p in expected.rglob("*") if p.is_file())
    assert files, expected
    assert sorted(p.relative_to(actual) for p in actual.rglob("*") if p.is_file()) == files
    for rel in files:
        assert filecmp.cmp(expected / rel, actual / rel, shallow=False), f"{rel} differs from upstream's"


def test_sudoku_matches_upstream_build(tmp_path):
    # upstream: np.random.seed(0); build_sudoku_dataset.py --subsample-size 12 --num-aug 2
    sudoku.main(
        [
            "--source-dir",
            str(SOURCES / "sudoku"),
            "--output-dir",
            str(tmp_path / "sudoku"),
            "--subsample-size",
            "12",
            "--num-aug",
            "2",
            "--seed",
            "0",
        ]
    )
    assert_same_tree(ROOT / "sudoku", tmp_path / "sudoku")


def test_maze_matches_upstream_build(tmp_path):
    # upstream: np.random.seed(0); build_maze_dataset.py --subsample-size 4 --aug
    maze.main(
        [
            "--source-dir",
            str(SOURCES / "maze"),
            "--output-dir",
            str(tmp_path / "maze"),
            "--subsample-size",
            "4",
            "--aug",
            "--seed",
            "0",
        ]
    )
    assert_same_tree(ROOT / "maze", tmp_path / "maze")


@pytest.mark.parametrize(
    "builder, repo, args",
    [
        (sudoku, "sapientinc/sudoku-extreme", ["--subsample-size", "12", "--num-aug", "2", "--seed", "0"]),
        (maze, "sapientinc/maze-30x30-hard-1k", ["--subsample-size", "4", "--aug", "--seed", "0"]),
    ],
)
def test_default_source_is_upstreams_hugging_face_dataset(builder, repo, args, tmp_path, monkeypatch):
    """Without --source-dir the CSVs come from upstream's Hugging Face dataset; the download is
    served here from the local copies of those files."""
    import huggingface_hub

    name = builder.__name__.rsplit(".", 1)[-1]
    requests = []

    def download(repo_id, filename, repo_type=None):
        requests.append((repo_id, filename, repo_type))
        return str(SOURCES / name / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    builder.main(["--output-dir", str(tmp_path / name), *args])
    assert requests == [(repo, "train.csv", "dataset"), (repo, "test.csv", "dataset")]
    assert_same_tree(ROOT / name, tmp_path / name)


def test_download_failure_names_the_dataset_and_the_offline_option(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id, filename, repo_type=None):
        raise LocalEntryNotFoundError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(
        JaxportError, match="train.csv of the Hugging Face dataset sapientinc/sudoku-extreme.*--source-dir"
    ):
        sudoku.main(["--output-dir", str(tmp_path / "o")])


def test_arc_matches_upstream_build(tmp_path):
    arc.main(
        [
            "--input-file-prefix",
            str(SOURCES / "arc" / "arc-agi"),
            "--output-dir",
            str(tmp_path / "arc"),
            "--subsets",
            "training",
            "evaluation",
            "--test-set-name",
            "evaluation",
            "--num-aug",
            "3",
        ]
    )
    assert_same_tree(ROOT / "arc", tmp_path / "arc")


def test_sudoku_shuffle_keeps_solutions_valid():
    rng = np.random.RandomState(3)
    question, answer = sudoku.generate_puzzle(30, rng)
    board = np.array([int(c) if c != "." else 0 for c in question]).reshape(9, 9)
    solution = np.array([int(c) for c in answer]).reshape(9, 9)
    for _ in range(5):
        b, s = sudoku.shuffle_sudoku(board, solution, rng)
        assert_valid_solution(s)
        assert np.all((b == 0) | (b == s)) and np.sum(b > 0) == 30


def assert_valid_solution(grid):
    digits = set(range(1, 10))
    for i in range(9):
        assert set(grid[i]) == digits and set(grid[:, i]) == digits
        r, c = 3 * (i // 3), 3 * (i % 3)
        assert set(grid[r : r + 3, c : c + 3].reshape(-1)) == digits


def test_generated_sudoku_dataset(tmp_path):
    out = tmp_path / "gen"
    sudoku.main(
        [
            "--generate",
            "--output-dir",
            str(out),
            "--num-train",
            "6",
            "--num-test",
            "3",
            "--givens",
            "28",
            "--num-aug",
            "1",
            "--seed",
            "5",
        ]
    )
    train = np.load(out / "train" / "all__inputs.npy")
    assert train.shape == (12, 81)
    for split in ("train", "test"):
        inputs = np.load(out / split / "all__inputs.npy")
        labels = np.load(out / split / "all__labels.npy")
        for inp, lab in zip(inputs, labels):
            solution, puzzle = lab.reshape(9, 9) - 1, inp.reshape(9, 9) - 1
            assert_valid_solution(solution)
            assert np.sum(puzzle > 0) == 28 and np.all((puzzle == 0) | (puzzle == solution))
            cells = [int(v) for v in puzzle.reshape(-1)]
            assert sudoku._Board(cells).count_solutions(2) == 1
    ds = PuzzleDataset([out], "test", global_batch_size=4, test_set_mode=True)
    assert ds.metadata.total_puzzles == 3 and ds.metadata.vocab_size == 11
    # the same seed builds the same dataset
    sudoku.main(
        [
            "--generate",
            "--output-dir",
            str(tmp_path / "again"),
            "--num-train",
            "6",
            "--num-test",
            "3",
            "--givens",
            "28",
            "--num-aug",
            "1",
            "--seed",
            "5",
        ]
    )
    assert_same_tree(out, tmp_path / "again")


def test_uniqueness_check_sees_two_solutions():
    _, answer = sudoku.generate_puzzle(40, np.random.RandomState(0))
    cells = [int(c) for c in answer]
    for i in range(27):
        cells[i] = 0  # an empty band: swapping two of its rows gives a second solution
    assert sudoku._Board(cells).count_solutions(2) == 2


def test_dihedral_inverse_roundtrip():
    grid = np.arange(12).reshape(3, 4)
    for tid in range(8):
        np.testing.assert_array_equal(inverse_dihedral_transform(dihedral_transform(grid, tid), tid), grid)
    assert (
        len({dihedral_transform(grid, t).tobytes() + bytes(dihedral_transform(grid, t).shape) for t in range(8)}) == 8
    )


def test_arc_augmentation_inverts():
    rng = np.random.RandomState(1)
    grid = rng.randint(0, 10, size=(4, 7)).astype(np.uint8)
    for _ in range(10):
        name, forward = arc.augment("abcd1234", rng)
        original, back = arc.inverse_augment(name)
        assert original == "abcd1234"
        np.testing.assert_array_equal(back(forward(grid)), grid)


def test_builder_errors(tmp_path):
    with pytest.raises(JaxportError, match="--source-dir not found"):
        sudoku.main(["--source-dir", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "o")])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.csv").write_text("source,question,answer,rating\nx,123,456,0\n")
    (bad / "test.csv").write_text("source,question,answer,rating\n")
    with pytest.raises(JaxportError, match=r"train.csv row 2 question: a Sudoku grid needs 81 characters, got 3"):
        sudoku.main(["--source-dir", str(bad), "--output-dir", str(tmp_path / "o")])
    with pytest.raises(JaxportError, match="--givens must be between 17 and 81"):
        sudoku.main(["--generate", "--output-dir", str(tmp_path / "o"), "--givens", "12"])
    (bad / "train.csv").write_text("source,question,answer,rating\nx,#SxG,#SoG,0\n")
    with pytest.raises(JaxportError, match=r"row 2: question has characters outside"):
        maze.main(["--source-dir", str(bad), "--output-dir", str(tmp_path / "o")])
    with pytest.raises(JaxportError, match="ARC file not found: .*nothing_training_challenges.json"):
        arc.main(
            [
                "--input-file-prefix",
                str(tmp_path / "nothing"),
                "--output-dir",
                str(tmp_path / "o"),
                "--subsets",
                "training",
                "--test-set-name",
                "evaluation",
            ]
        )


def test_builders_register_as_subcommands(tmp_path):
    import argparse

    from jaxport.trm.build import BUILDERS

    top = argparse.ArgumentParser(prog="jaxport trm build")
    subs = top.add_subparsers(dest="dataset", required=True)
    for name, (make_parser, build) in BUILDERS.items():
        subs.add_parser(name, parents=[make_parser(add_help=False)]).set_defaults(build=build)
    args = top.parse_args(["maze", "--source-dir", str(SOURCES / "maze"), "--output-dir", str(tmp_path / "m")])
    assert args.build(args) == tmp_path / "m"
    assert (tmp_path / "m" / "test" / "dataset.json").is_file()
