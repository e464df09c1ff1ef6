"""ARC evaluation as upstream's evaluators/arc.py: vote over augmented versions, pass@K, submission.

Every test-split row is a (possibly augmented) version of one test input. Its prediction is
cropped from the 30x30 canvas, mapped back to the original frame with the inverse of the
row's augmentation, and counted as a vote for that grid, together with sigmoid(q_halt) of the
row. Per test input the candidate grids are ranked by (number of votes, mean sigmoid(q))
descending - votes first, q only breaks ties - and a test input counts as solved at K if the
right grid is among the first K. pass@K is the mean over puzzles of the fraction of their test
inputs solved; `submission.json` holds the first `submission_K` grids per test input.
"""

import json
from pathlib import Path

import numpy as np

from jaxport.distributed import gather_objects
from jaxport.errors import JaxportError
from jaxport.trm.build.arc import GRID, arc_grid_to_np, grid_hash, inverse_augment


def crop(seq: np.ndarray) -> np.ndarray:
    """The largest top-left rectangle of colour tokens (2..11) on the canvas, as colours 0..9."""
    grid = np.asarray(seq).reshape(GRID, GRID)
    is_colour = (grid >= 2) & (grid <= 11)
    first_other = np.where(is_colour.all(axis=1), GRID, np.argmin(is_colour, axis=1))
    # Scanning rows top-down, the usable width only shrinks: a running minimum.
    width = np.minimum.accumulate(first_other)
    area = np.arange(1, GRID + 1) * width
    rows = int(np.argmax(area)) + 1  # the first (fewest rows) of equal areas, as upstream
    if area[rows - 1] == 0:
        return np.zeros((0, 0), np.uint8)
    return (grid[:rows, : width[rows - 1]] - 2).astype(np.uint8)


class ARCEvaluator:
    """Collects predictions batch by batch (`update_batch`) and scores them (`result`).

    `data_path` is the ARC dataset folder (its identifiers.json and test_puzzles.json).
    With `aggregated_voting` (upstream's default) votes accumulate across `begin_eval` calls.
    """

    required_outputs = ("inputs", "puzzle_identifiers", "q_halt_logits", "preds")

    def __init__(
        self,
        data_path,
        blank_identifier_id: int = 0,
        submission_K: int = 2,
        pass_Ks=(1, 2, 5, 10, 100, 1000),
        aggregated_voting: bool = True,
    ):
        data_path = Path(data_path)
        self.identifier_map = self._read(data_path / "identifiers.json")
        self.test_puzzles = self._read(data_path / "test_puzzles.json")
        self.blank_identifier_id = blank_identifier_id
        self.submission_K = submission_K
        self.pass_Ks = tuple(pass_Ks)
        self.aggregated_voting = aggregated_voting
        self._grids = {}  # grid hash -> grid
        self._votes = {}  # puzzle name -> input hash -> [(grid hash, sigmoid(q))]

    @staticmethod
    def _read(path: Path):
        if not path.is_file():
            raise JaxportError(f"ARC evaluator needs {path} (written by `jaxport trm build arc`)")
        return json.loads(path.read_text())

    def begin_eval(self) -> None:
        if not self.aggregated_voting:
            self._grids, self._votes = {}, {}

    def update_batch(self, batch: dict, outputs: dict) -> None:
        """`batch`: the loader batch (inputs, puzzle_identifiers); `outputs`: preds [B, 900]
        and q_halt_logits [B]. Padding rows (blank identifier) are skipped."""
        merged = {**batch, **outputs}
        missing = [k for k in self.required_outputs if k not in merged]
        if missing:
            raise JaxportError(f"ARC evaluator needs {', '.join(missing)} in the batch or the model outputs")
        identifiers = np.asarray(merged["puzzle_identifiers"])
        keep = identifiers != self.blank_identifier_id
        q = 1.0 / (1.0 + np.exp(-np.asarray(merged["q_halt_logits"], np.float64)))
        for identifier, inp, pred, q_row in zip(
            identifiers[keep], np.asarray(merged["inputs"])[keep], np.asarray(merged["preds"])[keep], q[keep]
        ):
            if not 0 <= identifier < len(self.identifier_map):
                raise JaxportError(
                    f"puzzle identifier {identifier} is not in identifiers.json ({len(self.identifier_map)} "
                    f"entries): the batches come from another dataset than the evaluator's"
                )
            name = self.identifier_map[int(identifier)]
            original, to_original = inverse_augment(name)
            input_hash = grid_hash(to_original(crop(inp)))
            pred_grid = to_original(crop(pred))
            pred_hash = grid_hash(pred_grid)
            self._grids[pred_hash] = pred_grid
            self._votes.setdefault(original, {}).setdefault(input_hash, []).append((pred_hash, float(q_row)))

    def result(self, save_path=None, gather=gather_objects) -> dict | None:
        """pass@K for every K (process 0; other processes get None); writes
        `<save_path>/submission.json` when `save_path` is given."""
        import jax

        states = gather((self._grids, self._votes))
        if jax.process_index() != 0:
            return None

        submission = {}
        solved = np.zeros(len(self.pass_Ks))
        for name, puzzle in self.test_puzzles.items():
            submission[name] = []
            solved_here = np.zeros(len(self.pass_Ks))
            for pair in puzzle["test"]:
                input_hash = grid_hash(arc_grid_to_np(pair["input"]))
                label_hash = grid_hash(arc_grid_to_np(pair["output"]))
                tally = {}  # grid hash -> [votes, sum of q]
                for _, votes in states:
                    for h, q in votes.get(name, {}).get(input_hash, []):
                        entry = tally.setdefault(h, [0, 0.0])
                        entry[0] += 1
                        entry[1] += q
                if not tally:
                    print(f"Puzzle {name} has no predictions.")
                    continue
                ranked = sorted(
                    ((h, (n, total / n)) for h, (n, total) in tally.items()), key=lambda kv: kv[1], reverse=True
                )
                for i, k in enumerate(self.pass_Ks):
                    solved_here[i] += any(h == label_hash for h, _ in ranked[:k])
                attempts = [next(grids[h] for grids, _ in states if h in grids) for h, _ in ranked[: self.submission_K]]
                attempts += [attempts[0]] * (self.submission_K - len(attempts))
                submission[name].append({f"attempt_{i + 1}": g.tolist() for i, g in enumerate(attempts)})
            solved += solved_here / len(puzzle["test"])

        if save_path is not None:
            Path(save_path).mkdir(parents=True, exist_ok=True)
            (Path(save_path) / "submission.json").write_text(json.dumps(submission))
        return {f"ARC/pass@{k}": float(solved[i] / len(self.test_puzzles)) for i, k in enumerate(self.pass_Ks)}
