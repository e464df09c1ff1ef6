"""The ARC evaluator reproduces upstream's result and submission.json on the recorded fake
predictions (tests/fixtures/trm/datasets, case.json "arc_evaluator")."""

from pathlib import Path

import numpy as np
import pytest

from jaxport.errors import JaxportError
from jaxport.trm.arc_eval import ARCEvaluator, crop

ROOT = Path(__file__).parent / "fixtures" / "trm" / "datasets"


@pytest.fixture(scope="module")
def recorded():
    with np.load(ROOT / "inputs.npz") as f:
        inputs = {k: f[k] for k in f.files}
    with np.load(ROOT / "expected.npz") as f:
        expected = {k: f[k] for k in f.files if k.startswith("arc_eval/")}
    return inputs, expected


def feed(evaluator, inputs, batches=(0, 1)):
    for b in batches:
        p = f"arc_eval/b{b}/"
        batch = {k: inputs[p + k] for k in ("inputs", "labels", "puzzle_identifiers")}
        evaluator.update_batch(batch, {"preds": inputs[p + "preds"], "q_halt_logits": inputs[p + "q_halt_logits"]})


def test_result_and_submission_match_upstream(recorded, tmp_path):
    inputs, expected = recorded
    evaluator = ARCEvaluator(ROOT / "arc")
    evaluator.begin_eval()
    feed(evaluator, inputs)
    result = evaluator.result(save_path=tmp_path)
    pass_ks = [int(k) for k in expected["arc_eval/pass_Ks"]]
    assert list(result) == [f"ARC/pass@{k}" for k in pass_ks]
    for key, value in result.items():
        np.testing.assert_allclose(value, expected[f"arc_eval/{key}"], rtol=1e-12, atol=0)
    assert (tmp_path / "submission.json").read_bytes() == (ROOT / "arc_eval" / "submission.json").read_bytes()


def test_votes_beat_q(recorded):
    # e4075551: the one right version has the highest q, three versions agree on a wrong grid
    inputs, _ = recorded
    evaluator = ARCEvaluator(ROOT / "arc", pass_Ks=(1, 2))
    feed(evaluator, inputs)
    evaluator.test_puzzles = {k: v for k, v in evaluator.test_puzzles.items() if k == "e4075551"}
    assert evaluator.result() == {"ARC/pass@1": 0.0, "ARC/pass@2": 1.0}


def test_aggregated_voting_flag(recorded):
    inputs, _ = recorded
    fresh = ARCEvaluator(ROOT / "arc", aggregated_voting=False)
    feed(fresh, inputs)
    fresh.begin_eval()  # forgets earlier votes
    feed(fresh, inputs, batches=(1,))
    assert "d19f7514" not in fresh._votes
    kept = ARCEvaluator(ROOT / "arc")
    feed(kept, inputs)
    kept.begin_eval()
    assert "d19f7514" in kept._votes


def reference_crop(seq):
    """Upstream's scan, written as a loop: rows top-down, the width shrinks at the first
    non-colour token, keep the first largest area."""
    grid = np.asarray(seq).reshape(30, 30)
    best, size, width = 0, (0, 0), 30
    for rows in range(1, 31):
        for c in range(width):
            if not 2 <= grid[rows - 1, c] <= 11:
                width = c
                break
        if rows * width > best:
            best, size = rows * width, (rows, width)
    return (grid[: size[0], : size[1]] - 2).astype(np.uint8)


def test_crop_matches_the_scan(recorded):
    inputs, _ = recorded
    rng = np.random.RandomState(0)
    seqs = [inputs[f"arc_eval/b{b}/{k}"][r] for b in (0, 1) for k in ("inputs", "preds", "labels") for r in range(8)]
    for _ in range(200):
        h, w = rng.randint(0, 31, size=2)
        canvas = np.zeros((30, 30), np.int32)
        canvas[:h, :w] = rng.randint(2, 12, size=(h, w))
        if rng.rand() < 0.5:
            canvas[rng.randint(0, 30), rng.randint(0, 30)] = rng.choice([0, 1, 12])
        seqs.append(canvas.reshape(-1))
    for seq in seqs:
        got, want = crop(seq), reference_crop(seq)
        assert got.shape == want.shape and np.array_equal(got, want)


def test_missing_files_and_outputs(tmp_path, recorded):
    with pytest.raises(JaxportError, match="needs .*identifiers.json"):
        ARCEvaluator(tmp_path)
    evaluator = ARCEvaluator(ROOT / "arc")
    inputs, _ = recorded
    with pytest.raises(JaxportError, match="needs q_halt_logits"):
        evaluator.update_batch(
            {k: inputs[f"arc_eval/b0/{k}"] for k in ("inputs", "puzzle_identifiers")},
            {"preds": inputs["arc_eval/b0/preds"]},
        )


def test_identifier_from_another_dataset(recorded):
    inputs, _ = recorded
    batch = {k: inputs[f"arc_eval/b0/{k}"].copy() for k in ("inputs", "puzzle_identifiers")}
    batch["puzzle_identifiers"][0] = 999
    with pytest.raises(JaxportError, match="puzzle identifier 999 is not in identifiers.json"):
        ARCEvaluator(ROOT / "arc").update_batch(
            batch, {"preds": inputs["arc_eval/b0/preds"], "q_halt_logits": inputs["arc_eval/b0/q_halt_logits"]}
        )
