"""A non-finite loss stops GPT and Dream training naming the first bad step and the last good checkpoint,
which is intact and resumes: a run diverges (a learning rate of 1e30), and the same run resumed from the
named checkpoint with a sane learning rate repeats the loss that checkpoint gave, bit for bit.
(TRM's case is tests/test_trm_train.py::test_nan_loss_stops_and_keeps_the_last_good_checkpoint.)"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxport import cli
from jaxport.errors import JaxportError

FIXTURES = Path(__file__).parent / "fixtures"
STOPPED = re.compile(
    r"(loss|gradient norm) is (nan|inf|-inf) at step (\d+); training stopped; the last good "
    r"checkpoint is step (\d+) in "
)


pytestmark = pytest.mark.usefixtures("keep_malloc_defaults")


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def logged(run: Path, key: str, step_key: str = "step") -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r[step_key], r[key]) for r in rows if key in r]


@pytest.mark.slow
def test_gpt_stops_at_a_non_finite_loss_and_resumes_from_the_named_checkpoint(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data" / "tinychar"
    data.mkdir(parents=True)
    shutil.copy(FIXTURES / "gpt" / "nanogpt_ckpt" / "meta.pkl", data / "meta.pkl")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 59, 2000).astype(np.uint16).tofile(data / f"{split}.bin")
    monkeypatch.chdir(tmp_path)
    flags = [
        "--device=cpu",
        "--dataset=tinychar",
        "--out_dir=run",
        "--block_size=16",
        "--batch_size=2",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--gradient_accumulation_steps=2",
        "--eval_interval=100",
        "--eval_iters=1",
        "--progress=False",
        "--decay_lr=False",
    ]

    def train(*extra) -> int:
        return cli.main(["gpt", "train", *flags, *extra])

    assert train("--max_iters=4", "--checkpoint_interval=2") == 0
    good = snapshot(tmp_path / "run" / "jaxport_checkpoints" / "4")
    capsys.readouterr()
    before = len(logged(tmp_path / "run", "loss", "iter"))
    assert train("--init_from=resume", "--max_iters=12", "--checkpoint_interval=100", "--learning_rate=1e30") == 1
    said = capsys.readouterr().err.strip().splitlines()
    err = [line for line in said if not line.startswith("runtime: ")]  # all but the start-up line
    assert len(said) == 2 and len(err) == 1 and err[0].startswith("jaxport gpt: error: "), said
    found = STOPPED.search(err[0])
    assert found and int(found.group(3)) > 4 and found.group(4) == "4", err[0]
    first_bad = int(found.group(3))
    diverged = dict(logged(tmp_path / "run", "loss", "iter")[before:])
    assert sorted(diverged) == list(range(4, first_bad)), "every iteration before the bad one was logged"
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "jaxport_checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 4] and snapshot(tmp_path / "run" / "jaxport_checkpoints" / "4") == good
    # the named checkpoint resumes: iteration 4 sees the same weights and batch, so the same loss
    before = len(logged(tmp_path / "run", "loss", "iter"))
    assert train("--init_from=resume", "--max_iters=6", "--checkpoint_interval=2") == 0
    resumed = dict(logged(tmp_path / "run", "loss", "iter")[before:])
    assert sorted(resumed) == [4, 5, 6] and resumed[4] == diverged[4]
    assert all(np.isfinite(v) for v in resumed.values())


@pytest.mark.slow
def test_dream_stops_at_a_non_finite_loss_and_resumes_from_the_named_checkpoint(tmp_path):
    from jaxport.dream import train as dream_train

    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"add {i}+{i}=", "completion": str(2 * i)}) + "\n" for i in range(16))
    )
    options = dict(
        model=str(FIXTURES / "dream" / "tiny_sharded" / "model"),
        data=str(data),
        out_dir=str(tmp_path / "run"),
        seq_len=24,
        batch_size=4,
        warmup_steps=1,
        samples=0,
    )
    dream_train.train(**options, steps=4, save_every=2)
    checkpoints = tmp_path / "run" / "jaxport_checkpoints"
    good = snapshot(checkpoints / "4")
    before = len(logged(tmp_path / "run", "train/loss"))
    with pytest.raises(JaxportError) as stopped:
        dream_train.train(**options, steps=12, save_every=100, lr=1e38, grad_clip=0.0)
    found = STOPPED.search(str(stopped.value))
    assert found and int(found.group(3)) > 5 and found.group(4) == "4", str(stopped.value)
    diverged = dict(logged(tmp_path / "run", "train/loss")[before:])
    assert sorted(diverged) == list(range(5, int(found.group(3))))
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2, 4]
    assert snapshot(checkpoints / "4") == good
    before = len(logged(tmp_path / "run", "train/loss"))
    result = dream_train.train(**options, steps=6, save_every=2)
    resumed = dict(logged(tmp_path / "run", "train/loss")[before:])
    assert result["step"] == 6 and sorted(resumed) == [5, 6] and resumed[5] == diverged[5]
    assert all(np.isfinite(v) for v in resumed.values())


def test_a_state_holding_a_nan_is_never_checkpointed(tmp_path):
    """Whatever the loop checked, `Run.save` refuses non-finite weights, naming the step and the last good
    checkpoint (e.g. an update that overflowed while the loss it was computed from was finite)."""
    import jax.numpy as jnp

    from jaxport.training.run import Run

    with Run(tmp_path / "run", total_steps=3, progress=False) as run:
        run.save(1, {"w": jnp.ones(3), "step": jnp.int32(1)})
        with pytest.raises(
            JaxportError,
            match=r"^the state to checkpoint holds 2 NaN or infinite weight or "
            r"optimizer value\(s\) at step 2; training stopped; the last good "
            r"checkpoint is step 1 in ",
        ):
            run.save(2, {"w": jnp.array([1.0, jnp.nan, jnp.inf]), "step": jnp.int32(2)})
    assert sorted(p.name for p in (tmp_path / "run" / "jaxport_checkpoints").iterdir()) == ["1"]
