"""PuzzleDataset over folders built by upstream's builders gives upstream's batches
(tests/fixtures/trm/datasets, case.json "loader"), shards per process and resumes exactly."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxport.errors import JaxportError
from jaxport.trm.data import IGNORE_LABEL_ID, PuzzleDataset

ROOT = Path(__file__).parent / "fixtures" / "trm" / "datasets"
CASE = json.loads((ROOT / "case.json").read_text())
FIELDS = ("inputs", "labels", "puzzle_identifiers")


@pytest.fixture(scope="module")
def expected():
    with np.load(ROOT / "expected.npz") as f:
        return {k: f[k] for k in f.files}


def make(name, split, **overrides):
    cfg = dict(CASE["loader"][name][split]["config"])
    cfg.update(overrides)
    return PuzzleDataset(
        [ROOT / name],
        "test" if cfg["test_set_mode"] else "train",
        global_batch_size=cfg["global_batch_size"],
        test_set_mode=cfg["test_set_mode"],
        epochs_per_iter=cfg["epochs_per_iter"],
        seed=cfg["seed"],
        rank=cfg.get("rank", 0),
        num_replicas=cfg.get("num_replicas", 1),
    )


@pytest.mark.parametrize("name", ["sudoku", "arc", "maze"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_recorded_batches(name, split, expected):
    record = CASE["loader"][name][split]
    ds = make(name, split)
    meta = {k: v for k, v in vars(ds.metadata).items()}
    assert meta == record["metadata"]
    batches = list(ds)
    n = record["num_batches_recorded"]
    assert [b[2] for b in batches[:n]] == record["effective_global_batch_sizes"]
    for i in range(n):
        set_name, batch, _ = batches[i]
        assert set_name == "all"
        for k in FIELDS:
            want = expected[f"loader/{name}/{split}/b{i}/{k}"]
            assert batch[k].dtype == np.int32
            np.testing.assert_array_equal(batch[k], want, err_msg=f"{name}/{split}/b{i}/{k}")
    if split == "test":
        assert len(batches) == n  # test mode walks everything once
        last = batches[-1][1]
        pad = slice(batches[-1][2], None)  # rows past the effective size are padding
        assert np.all(last["labels"][pad] == IGNORE_LABEL_ID) and np.all(last["inputs"][pad] == 0)


@pytest.mark.parametrize("name", ["sudoku", "arc"])
def test_train_mode_covers_groups_and_drops_last(name):
    ds = make(name, "train")
    batches = list(ds)
    groups = CASE["loader"][name]["train"]["metadata"]["total_groups"]
    assert all(b[2] == 8 for b in batches)
    if name == "sudoku":  # one example per puzzle: 2 epochs x 12 groups = 24 examples -> 3 batches
        assert len(batches) == 2 * groups // 8
    again = list(make(name, "train"))  # same seed, same first iteration
    for (_, a, _), (_, b, _) in zip(batches, again):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    second = list(ds)  # the next iteration reshuffles
    assert any(not np.array_equal(a["inputs"], b["inputs"]) for (_, a, _), (_, b, _) in zip(batches, second))


@pytest.mark.parametrize("name,split", [("arc", "train"), ("arc", "test"), ("sudoku", "test"), ("maze", "train")])
def test_ranks_read_their_slice_of_the_global_batch(name, split):
    whole = list(make(name, split))
    parts = [list(make(name, split, rank=r, num_replicas=2)) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(whole)
    for i, (_, batch, size) in enumerate(whole):
        for k in FIELDS:
            joined = np.concatenate([parts[0][i][1][k], parts[1][i][1][k]])
            np.testing.assert_array_equal(joined, batch[k])
        assert parts[0][i][2] == parts[1][i][2] == size
        assert parts[0][i][1]["inputs"].shape[0] == 4


def test_examples_stay_memory_mapped():
    ds = make("arc", "train")
    next(iter(ds))
    assert isinstance(ds._data["all"]["inputs"], np.memmap)


@pytest.mark.parametrize("stop_after", [1, 5, 6, 9])
def test_resume_from_state_dict_continues_the_same_stream(stop_after):
    def stream(ds, iterations):
        out = []
        for _ in range(iterations):
            out += [b["inputs"] for _, b, _ in ds]
        return out

    reference = stream(make("arc", "train", epochs_per_iter=1), 3)  # 5 batches per iteration here
    ds = make("arc", "train", epochs_per_iter=1)
    taken, state = [], None
    while len(taken) < stop_after:
        for _, b, _ in ds:
            taken.append(b["inputs"])
            if len(taken) == stop_after:
                state = json.loads(json.dumps(ds.state_dict()))  # must survive a JSON checkpoint
                break
    resumed = make("arc", "train", epochs_per_iter=1)
    resumed.load_state_dict(state)
    rest = []
    while len(taken) + len(rest) < len(reference):
        rest += [b["inputs"] for _, b, _ in resumed]
    for i, (a, b) in enumerate(zip(taken + rest, reference)):
        np.testing.assert_array_equal(a, b, err_msg=f"batch {i}")


def test_state_from_another_configuration_is_refused():
    state = make("sudoku", "train").state_dict()
    with pytest.raises(JaxportError, match="global_batch_size=8 but this run uses 4"):
        make("sudoku", "train", global_batch_size=4).load_state_dict(state)


def test_bad_inputs_have_clear_errors(tmp_path):
    with pytest.raises(JaxportError, match="dataset folder not found: .*nowhere"):
        PuzzleDataset([tmp_path / "nowhere"], global_batch_size=8, test_set_mode=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(JaxportError, match=r"not a puzzle dataset: .*empty/train/dataset.json is missing"):
        PuzzleDataset([tmp_path / "empty"], global_batch_size=8, test_set_mode=False)
    with pytest.raises(JaxportError, match="multiple of the number of processes"):
        make("sudoku", "train", global_batch_size=9, num_replicas=2)

    broken = tmp_path / "broken"
    shutil.copytree(ROOT / "sudoku", broken)
    np.save(broken / "train" / "all__inputs.npy", np.zeros((36, 80), np.uint8))
    ds = PuzzleDataset([broken], global_batch_size=8, test_set_mode=False)
    with pytest.raises(JaxportError, match=r"all__inputs.npy has shape \(36, 80\), expected \[examples, 81\]"):
        next(iter(ds))
    (broken / "train" / "all__labels.npy").unlink()
    with pytest.raises(JaxportError, match="dataset file missing: .*all__labels.npy"):
        next(iter(PuzzleDataset([broken], global_batch_size=8, test_set_mode=False)))


def test_two_datasets_merge_metadata_and_sets():
    ds = PuzzleDataset([ROOT / "sudoku", ROOT / "sudoku"], "test", global_batch_size=8, test_set_mode=True)
    assert ds.metadata.total_groups == 12 and ds.metadata.num_puzzle_identifiers == 2
    assert [name for name, _, _ in ds] == ["all", "all1"]
    with pytest.raises(JaxportError, match="differ in seq_len"):
        PuzzleDataset([ROOT / "sudoku", ROOT / "maze"], global_batch_size=8, test_set_mode=False)
