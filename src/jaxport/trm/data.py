"""Puzzle datasets in upstream TRM's on-disk format, batched as upstream's `PuzzleDataset`.

A dataset folder holds `identifiers.json` and one folder per split (`train`, `test`), each
with `dataset.json` (the metadata) and, per set name in `sets`, the arrays
`<set>__inputs.npy`, `<set>__labels.npy` ([examples, seq_len]),
`<set>__puzzle_identifiers.npy` ([puzzles]), `<set>__puzzle_indices.npy` ([puzzles + 1],
example offsets) and `<set>__group_indices.npy` ([groups + 1], puzzle offsets). A group is
a puzzle with its augmented versions.

Training mode, per set and per "iteration" (one pass of `__iter__`, `epochs_per_iter`
epochs): groups are shuffled with `Philox(seed + iteration)`, each group contributes one
random puzzle (same generator) and examples are drawn from that puzzle without replacement
with numpy's legacy `RandomState` (upstream uses the global `np.random`, which is the same
generator; here it is owned by the dataset so that its state can be checkpointed). The last
incomplete batch is dropped. Test mode walks every example in order and pads the last batch.
Every process reads only its own `global_batch_size / num_replicas` rows (memory-mapped).
"""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from jaxport.errors import JaxportError

IGNORE_LABEL_ID = -100
FIELDS = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")


@dataclasses.dataclass(frozen=True)
class PuzzleDatasetMetadata:
    """`dataset.json`, fields in upstream's order (the builders write it byte-for-byte)."""

    pad_id: int
    ignore_label_id: int | None
    blank_identifier_id: int
    vocab_size: int
    seq_len: int
    num_puzzle_identifiers: int
    total_groups: int
    mean_puzzle_examples: float
    total_puzzles: int
    sets: list[str]

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["mean_puzzle_examples"] = float(fields["mean_puzzle_examples"])
        return json.dumps(fields)

    @classmethod
    def load(cls, split_dir: Path) -> "PuzzleDatasetMetadata":
        path = split_dir / "dataset.json"
        if not path.is_file():
            raise JaxportError(
                f"not a puzzle dataset: {path} is missing (expected a folder built by "
                f"`jaxport trm build ...` or upstream's dataset/build_*.py)"
            )
        try:
            fields = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise JaxportError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(fields, dict):
            raise JaxportError(f"{path} must hold a JSON object with the dataset metadata")
        if "total_puzzles" not in fields:  # datasets built by HRM's scripts lack it
            indices = split_dir / "all__puzzle_indices.npy"
            fields["total_puzzles"] = len(np.load(indices)) - 1 if indices.is_file() else fields.get("total_groups", 0)
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in fields]
        if missing:
            raise JaxportError(f"{path} lacks the metadata field(s) {', '.join(missing)}")
        return cls(**{n: fields[n] for n in names})


class PuzzleDataset:
    """Iterate `(set_name, batch, global_effective_batch_size)` as upstream's PuzzleDataset.

    `batch` holds int32 numpy arrays `inputs` and `labels` [local_batch, seq_len] (labels equal
    to `ignore_label_id` become -100) and `puzzle_identifiers` [local_batch]. In training mode
    each `iter()` runs one iteration (or finishes one left unfinished, e.g. by a restored
    checkpoint or a `break`); `state_dict()` / `load_state_dict()` save and restore the
    position (iteration, set, place in the shuffled group order and both RNGs) so that a resumed
    run draws exactly the batches an uninterrupted one would.
    """

    def __init__(
        self,
        dataset_paths,
        split: str = "train",
        *,
        global_batch_size: int,
        test_set_mode: bool,
        epochs_per_iter: int = 1,
        seed: int = 0,
        rank: int = 0,
        num_replicas: int = 1,
    ):
        if isinstance(dataset_paths, (str, os.PathLike)):
            dataset_paths = [dataset_paths]
        self.dataset_paths = [Path(p) for p in dataset_paths]
        if not self.dataset_paths:
            raise JaxportError("no dataset path given (data_paths is empty)")
        if global_batch_size <= 0 or global_batch_size % num_replicas:
            raise JaxportError(
                f"global_batch_size {global_batch_size} must be a positive multiple of the "
                f"number of processes ({num_replicas})"
            )
        if not 0 <= rank < num_replicas:
            raise JaxportError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.split = split
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // num_replicas
        self.test_set_mode = test_set_mode
        self.epochs_per_iter = epochs_per_iter
        self.seed = seed
        self.rank = rank
        self.num_replicas = num_replicas
        self.metadata = self._merged_metadata()
        self._data = None
        # Upstream's `_iters` counter, the legacy RNG for examples within a puzzle, and the
        # position inside an unfinished iteration (None between iterations).
        self._iters = 0
        self._example_rng = np.random.RandomState(seed)
        self._position = None

    # ----- metadata and arrays

    def _split_dir(self, path: Path) -> Path:
        if not path.exists():
            raise JaxportError(f"dataset folder not found: {path}")
        if not path.is_dir():
            raise JaxportError(f"dataset path is not a folder: {path}")
        return path / self.split

    def _merged_metadata(self) -> PuzzleDatasetMetadata:
        metas = [(p, PuzzleDatasetMetadata.load(self._split_dir(p))) for p in self.dataset_paths]
        first_path, first = metas[0]
        for path, meta in metas[1:]:
            for field in ("seq_len", "vocab_size", "pad_id", "ignore_label_id", "blank_identifier_id", "sets"):
                if getattr(meta, field) != getattr(first, field):
                    raise JaxportError(
                        f"datasets {first_path} and {path} differ in {field} "
                        f"({getattr(first, field)!r} vs {getattr(meta, field)!r}); they cannot be mixed"
                    )
        total_puzzles = sum(m.total_puzzles for _, m in metas)
        return dataclasses.replace(
            first,
            num_puzzle_identifiers=sum(m.num_puzzle_identifiers for _, m in metas),
            total_groups=sum(m.total_groups for _, m in metas),
            mean_puzzle_examples=sum(m.mean_puzzle_examples * m.total_puzzles for _, m in metas)
            / max(total_puzzles, 1),
            total_puzzles=total_puzzles,
        )

    def load(self) -> dict:
        """Memory-map and check every array (on first use; call it early to fail before a run starts)."""
        if self._data is not None:
            return self._data
        data = {}
        for set_name in self.metadata.sets:
            for i, path in enumerate(self.dataset_paths):
                split_dir = path / self.split
                arrays = {}
                for field in FIELDS:
                    file = split_dir / f"{set_name}__{field}.npy"
                    if not file.is_file():
                        raise JaxportError(f"dataset file missing: {file}")
                    try:  # examples stay on disk; the small index arrays are read into memory
                        arrays[field] = np.load(file, mmap_mode="r" if field in ("inputs", "labels") else None)
                    except ValueError as err:
                        raise JaxportError(
                            f"dataset file is not a readable .npy array (truncated?): {file} ({err}); "
                            f"build the dataset again"
                        ) from None
                self._check(split_dir, set_name, arrays)
                data[set_name + (str(i) if i else "")] = arrays
        self._data = data
        return data

    def _check(self, split_dir: Path, set_name: str, a: dict) -> None:
        where = f"{split_dir}/{set_name}__"
        seq_len = self.metadata.seq_len
        for field in ("inputs", "labels"):
            if a[field].ndim != 2 or a[field].shape[1] != seq_len:
                raise JaxportError(
                    f"{where}{field}.npy has shape {a[field].shape}, expected [examples, {seq_len}] "
                    f"(seq_len from dataset.json)"
                )
        if a["labels"].shape[0] != a["inputs"].shape[0]:
            raise JaxportError(
                f"{where}labels.npy has {a['labels'].shape[0]} rows but inputs.npy has {a['inputs'].shape[0]}"
            )
        if a["puzzle_indices"].size < 1 or a["puzzle_indices"][-1] != a["inputs"].shape[0]:
            raise JaxportError(f"{where}puzzle_indices.npy must end at the number of examples ({a['inputs'].shape[0]})")
        if a["puzzle_identifiers"].size != a["puzzle_indices"].size - 1:
            raise JaxportError(
                f"{where}puzzle_identifiers.npy has {a['puzzle_identifiers'].size} entries, "
                f"expected one per puzzle ({a['puzzle_indices'].size - 1})"
            )
        if a["group_indices"].size < 1 or a["group_indices"][-1] != a["puzzle_indices"].size - 1:
            raise JaxportError(
                f"{where}group_indices.npy must end at the number of puzzles ({a['puzzle_indices'].size - 1})"
            )

    # ----- batches

    def _collate(self, inputs, labels, puzzle_identifiers) -> dict:
        batch = {
            "inputs": np.asarray(inputs).astype(np.int32),
            "labels": np.asarray(labels).astype(np.int32),
            "puzzle_identifiers": np.asarray(puzzle_identifiers).astype(np.int32),
        }
        if self.metadata.ignore_label_id is not None:
            batch["labels"][batch["labels"] == self.metadata.ignore_label_id] = IGNORE_LABEL_ID
        pad = self.local_batch_size - batch["puzzle_identifiers"].size
        if pad > 0:
            fill = {
                "inputs": self.metadata.pad_id,
                "labels": IGNORE_LABEL_ID,
                "puzzle_identifiers": self.metadata.blank_identifier_id,
            }
            batch = {
                k: np.pad(v, ((0, pad),) + ((0, 0),) * (v.ndim - 1), constant_values=fill[k]) for k, v in batch.items()
            }
        return batch

    def _iter_test(self):
        for set_name, d in self.load().items():
            total = len(d["inputs"])
            offsets = d["puzzle_indices"]
            for start in range(0, total, self.global_batch_size):
                end = min(total, start + self.global_batch_size)
                local_start = start + self.rank * self.local_batch_size
                local_end = min(start + (self.rank + 1) * self.local_batch_size, end)
                examples = np.arange(local_start, max(local_start, local_end))
                puzzles = np.searchsorted(offsets, examples, side="right") - 1
                batch = self._collate(
                    d["inputs"][local_start:local_end],
                    d["labels"][local_start:local_end],
                    d["puzzle_identifiers"][puzzles],
                )
                yield set_name, batch, end - start

    def _group_order(self, group_count: int, iteration: int):
        rng = np.random.Generator(np.random.Philox(seed=self.seed + iteration))
        order = np.concatenate([rng.permutation(group_count) for _ in range(self.epochs_per_iter)])
        return rng, order

    def _sample_batch(self, rng, order, start: int, d: dict):
        """Fill one global batch: one random puzzle per group in `order`, then up to the rest of
        the batch of its examples (without replacement)."""
        groups, offsets = d["group_indices"], d["puzzle_indices"]
        examples, puzzles, size = [], [], 0
        while start < order.size and size < self.global_batch_size:
            group = order[start]
            puzzle = rng.integers(groups[group], groups[group + 1])
            start += 1
            first = offsets[puzzle]
            count = int(offsets[puzzle + 1] - first)
            take = min(count, self.global_batch_size - size)
            puzzles.append(np.full(take, puzzle, dtype=np.int32))
            examples.append(first + self._example_rng.choice(count, take, replace=False))
            size += take
        return start, np.concatenate(examples), np.concatenate(puzzles)

    def _iter_train(self):
        data = self.load()
        for set_index, (set_name, d) in enumerate(data.items()):
            position = self._position
            if position is not None and set_index < position["set_index"]:
                continue  # finished before the checkpoint
            if position is None:
                self._iters += 1
                rng, order = self._group_order(d["group_indices"].size - 1, self._iters)
                start = 0
            else:
                rng, order = self._group_order(d["group_indices"].size - 1, self._iters)
                rng.bit_generator.state = position["philox"]
                start = position["start_index"]
            while start < order.size:
                start, examples, puzzles = self._sample_batch(rng, order, start, d)
                effective = puzzles.size
                if effective < self.global_batch_size:
                    break
                local = slice(self.rank * self.local_batch_size, (self.rank + 1) * self.local_batch_size)
                examples, puzzles = examples[local], puzzles[local]
                batch = self._collate(d["inputs"][examples], d["labels"][examples], d["puzzle_identifiers"][puzzles])
                self._position = {"set_index": set_index, "start_index": start, "philox": rng.bit_generator.state}
                yield set_name, batch, effective
            self._position = None

    def __iter__(self):
        return self._iter_test() if self.test_set_mode else self._iter_train()

    # ----- checkpointing

    def state_dict(self) -> dict:
        """JSON-serialisable position after the last batch handed out."""
        _, keys, pos, has_gauss, cached = self._example_rng.get_state()
        position = None
        if self._position is not None:
            position = {
                "set_index": self._position["set_index"],
                "start_index": int(self._position["start_index"]),
                "philox": _to_json(self._position["philox"]),
            }
        return {
            "iters": self._iters,
            "position": position,
            "example_rng": {
                "keys": keys.tolist(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "seed": self.seed,
            "epochs_per_iter": self.epochs_per_iter,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "epochs_per_iter", "global_batch_size"):
            if state.get(key) != getattr(self, key):
                raise JaxportError(
                    f"data position was saved with {key}={state.get(key)!r} but this run uses "
                    f"{getattr(self, key)!r}; the batches would differ"
                )
        self._iters = int(state["iters"])
        rng = state["example_rng"]
        self._example_rng.set_state(
            ("MT19937", np.asarray(rng["keys"], np.uint32), rng["pos"], rng["has_gauss"], rng["cached_gaussian"])
        )
        position = state["position"]
        self._position = (
            None
            if position is None
            else {
                "set_index": position["set_index"],
                "start_index": position["start_index"],
                "philox": _from_json_philox(position["philox"]),
            }
        )


def _to_json(obj):
    if isinstance(obj, dict):
        return {k: _to_json(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return [int(x) for x in obj]
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _from_json_philox(state: dict) -> dict:
    return {
        "bit_generator": state["bit_generator"],
        "state": {k: np.asarray(v, np.uint64) for k, v in state["state"].items()},
        "buffer": np.asarray(state["buffer"], np.uint64),
        "buffer_pos": state["buffer_pos"],
        "has_uint32": state["has_uint32"],
        "uinteger": state["uinteger"],
    }
