"""Dream masked-diffusion training: the objective, data rows, the tokenizer trainer, training and resume,
Hugging Face export, and bad input (the synthetic-task model: test_dream_tasks.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxport import cli, dream
from jaxport.dream import tasks
from jaxport.dream import train as train_lib
from jaxport.dream.data import Batches, load_rows
from jaxport.dream.params import save_pretrained
from jaxport.dream.tokenizer import CHATML_TEMPLATE, DREAM_ADDED_TOKENS, special_token_ids, train_tokenizer
from jaxport.errors import JaxportError

FIXTURES = Path(__file__).parent / "fixtures" / "dream"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tokenizer trained on synthetic problems and SFT data written from them."""
    root = tmp_path_factory.mktemp("dream_train")
    train, test = tasks.train_and_test(600, 8, seed=3)
    tasks.write_problems(train, root / "train.jsonl")
    tasks.write_problems(test, root / "test.jsonl")
    assert (
        cli.main(
            [
                "dream",
                "tokenizer",
                "--input",
                str(root / "train.jsonl"),
                "--output",
                str(root / "tokenizer"),
                "--vocab-size",
                "400",
            ]
        )
        == 0
    )
    return root


def tiny_options(workdir: Path, out_dir: Path, **overrides) -> dict:
    options = dict(
        config="tiny",
        tokenizer=str(workdir / "tokenizer"),
        data=str(workdir / "train.jsonl"),
        out_dir=str(out_dir),
        seq_len=32,
        response_len=16,
        batch_size=8,
        steps=30,
        lr=3e-3,
        warmup_steps=5,
        save_every=10,
        samples=1,
        sample_tokens=8,
        seed=0,
    )
    return options | overrides


def losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs again the steps after its checkpoint)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}


# ----- the objective


@pytest.mark.slow
def test_prompt_and_padding_are_never_masked():
    response = np.zeros((4, 12), bool)
    response[:, 5:] = True
    ids = jnp.arange(48, dtype=jnp.int32).reshape(4, 12)
    for seed in range(20):
        noisy, masked, t = train_lib.mask_response(jax.random.key(seed), ids, jnp.asarray(response), 1e-3, 99)
        masked, noisy = np.asarray(masked), np.asarray(noisy)
        assert not masked[:, :5].any()
        np.testing.assert_array_equal(noisy, np.where(masked, 99, np.asarray(ids)))
        assert np.all((1e-3 <= np.asarray(t)) & (np.asarray(t) < 1))
    # with t near 1 every response token is masked
    _, masked, _ = train_lib.mask_response(jax.random.key(0), ids, jnp.asarray(response), 0.99999, 99)
    np.testing.assert_array_equal(np.asarray(masked), response)


@pytest.mark.slow
def test_loss_is_one_over_t_weighted_and_normalised_per_response_token():
    rng = np.random.default_rng(0)
    B, L, V = 3, 7, 11
    logits = rng.normal(size=(B, L, V)).astype(np.float32)
    target = rng.integers(0, V, (B, L))
    response = np.zeros((B, L), bool)
    response[0, 2:], response[1, 4:], response[2, 1:] = True, True, True
    masked = response & (rng.random((B, L)) < 0.6)
    masked[0, 0] = False
    t = np.array([0.2, 0.5, 0.9], np.float32)
    loss = train_lib.masked_diffusion_loss(
        jnp.asarray(logits), jnp.asarray(target), jnp.asarray(masked), jnp.asarray(response), jnp.asarray(t)
    )
    expected = []
    for b in range(B):
        total = 0.0
        for j in np.nonzero(masked[b])[0]:
            scores = logits[b, max(j - 1, 0)]  # Dream's shift: position j is predicted at j - 1
            log_probs = scores - np.log(np.sum(np.exp(scores - scores.max()))) - scores.max()
            total -= log_probs[target[b, j]]
        expected.append(total / t[b] / response[b].sum())
    np.testing.assert_allclose(float(loss), np.mean(expected), rtol=1e-6)


# ----- data and tokenizer


def test_sft_rows_left_pad_the_prompt_before_a_fixed_response(workdir):
    config = dream.DreamConfig(**special_token_ids(workdir / "tokenizer"))
    tokenizer = dream.DreamTokenizer.from_model_dir(workdir / "tokenizer", config)
    data = workdir / "one.jsonl"
    data.write_text(
        json.dumps({"prompt": "add 1+2=", "completion": "3"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    rows = load_rows(data, tokenizer, seq_len=96, response_len=24, chat=False)
    prompt, answer = tokenizer.encode("add 1+2="), tokenizer.encode("3")
    first = rows.input_ids[0]
    np.testing.assert_array_equal(first[72 - len(prompt) : 72], prompt)
    assert (first[: 72 - len(prompt)] == tokenizer.pad_token_id).all() and not rows.attention_mask[
        0, : 72 - len(prompt)
    ].any()
    np.testing.assert_array_equal(first[72 : 72 + len(answer)], answer)
    assert (first[72 + len(answer) :] == tokenizer.eos_token_id).all()  # end-of-text padding is part of the response
    np.testing.assert_array_equal(rows.response_mask[0], np.arange(96) >= 72)
    # messages: the chat template's prompt, then the assistant's turn as the response
    chat_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    completion = tokenizer.encode("yo<|im_end|>\n")
    np.testing.assert_array_equal(
        rows.input_ids[1][72 - len(tokenizer.encode(chat_prompt)) : 72], tokenizer.encode(chat_prompt)
    )
    np.testing.assert_array_equal(rows.input_ids[1][72 : 72 + len(completion)], completion)


def test_batches_resume_where_they_stopped():
    whole = Batches(10, 4, seed=1)
    expected = [whole.next() for _ in range(6)]
    first = Batches(10, 4, seed=1)
    seen = [first.next() for _ in range(3)]
    resumed = Batches(10, 4, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    seen += [resumed.next() for _ in range(3)]
    np.testing.assert_array_equal(np.stack(seen), np.stack(expected))
    assert sorted(np.concatenate(expected[:5])[:10].tolist()) == list(range(10))  # each pass visits every row


def test_trained_tokenizer_has_dreams_special_tokens(tmp_path):
    texts = ["the cat sat on the mat\n", "the dog sat on the log\n", "12345 + 678 = 13023\n"] * 50
    out = train_tokenizer(texts, tmp_path / "tok", vocab_size=300)
    ids = special_token_ids(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    added = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    first = min(added)
    assert [added[first + i] for i in range(len(DREAM_ADDED_TOKENS))] == [c for c, _ in DREAM_ADDED_TOKENS]
    assert ids["mask_token_id"] == first + 23 and ids["eos_token_id"] == ids["pad_token_id"] == first
    assert ids["bos_token_id"] == first + 22 and ids["vocab_size"] % 64 == 0 and ids["vocab_size"] > first + 23
    cfg = dream.DreamConfig(**{**ids, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2})
    tok = dream.DreamTokenizer.from_model_dir(out, cfg)
    text = "the cat sat 123 <|mask|> ünïcode<|endoftext|>"
    encoded = tok.encode(text)
    assert tok.decode(encoded) == text and ids["mask_token_id"] in encoded and ids["eos_token_id"] in encoded
    assert len(tok.encode("the cat sat on the mat")) < len("the cat sat on the mat")  # merges were learned
    # the chat template renders conversations as Dream's does (its tool-free branch)
    official = json.loads((FIXTURES / "qwen2_tokenizer" / "tokenizer_config.json").read_text())["chat_template"]
    assert config["chat_template"] == CHATML_TEMPLATE
    for messages in (
        [{"role": "user", "content": "Add 2 and 3."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ],
    ):
        for add in (True, False):
            tok.chat_template = official
            want = tok.apply_chat_template(messages, add_generation_prompt=add)
            tok.chat_template = CHATML_TEMPLATE
            assert tok.apply_chat_template(messages, add_generation_prompt=add) == want


# ----- training, export, resume


@pytest.fixture(scope="module")
def trained(workdir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("run")
    result = train_lib.train(**tiny_options(workdir, out / "run", max_shard_size="40KB"))
    return {"out": out / "run", **result}


@pytest.mark.slow
def test_training_reduces_the_loss_and_leaves_a_run_folder(trained):
    run = trained["out"]
    curve = losses(run)
    assert sorted(curve) == list(range(1, 31)) and trained["step"] == 30
    assert np.mean([curve[s] for s in range(26, 31)]) < 0.5 * np.mean([curve[s] for s in range(1, 6)])
    for name in ("train_config.yaml", "learning_curves.png", "config.json", "tokenizer.json", "samples.jsonl"):
        assert (run / name).is_file(), name
    assert sorted(int(p.name) for p in (run / "jaxport_checkpoints").iterdir() if p.name.isdigit()) == [10, 20, 30]
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[-1])
    assert sample["step"] == 30 and isinstance(sample["completion"], str)


@pytest.mark.slow
def test_export_loads_with_the_same_logits(trained, tmp_path):
    export_dir = Path(trained["export_dir"])
    index = json.loads((export_dir / "model.safetensors.index.json").read_text())  # 40KB shards
    assert len(set(index["weight_map"].values())) > 1
    model, tokenizer = dream.load(export_dir)
    assert tokenizer.mask_token_id == model.config.mask_token_id
    ids = np.asarray([tokenizer.encode("sort 9431=") + [model.config.mask_token_id] * 6])
    # the run folder's newest checkpoint, exported again as one bfloat16 file: the same weights, rounded
    assert (
        cli.main(["dream", "export", str(trained["out"]), "--output", str(tmp_path / "bf16"), "--dtype", "bfloat16"])
        == 0
    )
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    bf16, _ = dream.load(tmp_path / "bf16", dtype="bfloat16")
    f32_as_bf16, _ = dream.load(export_dir, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(bf16(ids)), np.asarray(f32_as_bf16(ids)))
    # a model in memory and its export give identical logits, single file or sharded
    fresh = dream.random_model(model.config, seed=7)
    for shard in ("5GB", "30KB"):
        written = save_pretrained(fresh, tmp_path / shard, max_shard_size=shard, tokenizer_dir=export_dir)
        loaded, _ = dream.load(written)
        np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(fresh(ids)))


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_master_weights(workdir, trained, tmp_path):
    result = train_lib.train(**tiny_options(workdir, tmp_path / "bf16", steps=3, samples=0, dtype="bfloat16"))
    first_f32, first_bf16 = losses(trained["out"])[1], losses(tmp_path / "bf16")[1]  # same weights, batch, masks
    assert first_f32 != first_bf16 and abs(first_f32 - first_bf16) < 0.02 * first_f32
    w = load_file(Path(result["export_dir"]) / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == np.float32 and (w.astype(jnp.bfloat16).astype(np.float32) != w).any()  # not rounded to bf16


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_naming_the_last_good_checkpoint(workdir, tmp_path):
    options = tiny_options(
        workdir, tmp_path / "run", steps=6, save_every=1, samples=0, lr=1e38, warmup_steps=0, grad_clip=0.0
    )
    with pytest.raises(
        JaxportError,
        match=r"loss is (nan|inf) at step (\d); training stopped; the last good "
        r"checkpoint is step \d in ",
    ):
        train_lib.train(**options)
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "jaxport_checkpoints").iterdir() if p.name.isdigit())
    assert steps and max(steps) < 6 and not (tmp_path / "run" / "hf").exists()


def _train_command(workdir: Path, out_dir: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxport.cli",
        "dream",
        "train",
        "--config",
        "tiny",
        "--tokenizer",
        str(workdir / "tokenizer"),
        "--data",
        str(workdir / "train.jsonl"),
        "--out-dir",
        str(out_dir),
        "--seq-len",
        "32",
        "--response-len",
        "16",
        "--batch-size",
        "4",
        "--steps",
        str(steps),
        "--save-every",
        "50",
        "--samples",
        "0",
        "--lr",
        "1e-3",
    ]


@pytest.mark.slow
def test_resume_after_kill_9_repeats_the_uninterrupted_losses(workdir, tmp_path):
    steps = 300
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    reference = subprocess.run(
        _train_command(workdir, tmp_path / "whole", steps), env=env, capture_output=True, text=True, timeout=300
    )
    assert reference.returncode == 0, reference.stderr[-2000:]
    run_dir = tmp_path / "killed"
    process = subprocess.Popen(
        _train_command(workdir, run_dir, steps), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    while not (run_dir / "jaxport_checkpoints" / "100").is_dir():  # complete: orbax renames it when done
        assert process.poll() is None and time.monotonic() < deadline, "no checkpoint at step 100"
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    logged = losses(run_dir)
    assert max(logged) < steps, "the run finished before it was killed"
    resumed = subprocess.run(
        _train_command(workdir, run_dir, steps), env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed at step" in resumed.stdout + resumed.stderr
    assert losses(run_dir) == losses(tmp_path / "whole")  # bit for bit, every step


MESH_SCRIPT = """
import json, sys
from jaxport.dream import train
train.train(**json.loads(sys.argv[1]))
"""


@pytest.mark.slow
def test_eight_devices_fsdp_and_tensor_parallel_match_one_device(workdir, tmp_path):
    options = tiny_options(workdir, tmp_path / "one", steps=4, samples=0, grad_accum=2)
    train_lib.train(**options)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    options |= {"out_dir": str(tmp_path / "mesh"), "mesh": "2,2,2"}
    done = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, json.dumps(options)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "on 8 cpu device(s) {'data': 2, 'fsdp': 2, 'model': 2}" in done.stdout
    one, mesh = losses(tmp_path / "one"), losses(tmp_path / "mesh")
    np.testing.assert_allclose([mesh[s] for s in range(1, 5)], [one[s] for s in range(1, 5)], rtol=2e-5)


# ----- bad input: one clear line each


def _cli_error(capsys, argv) -> str:
    assert cli.main(["dream", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxport dream: error:"), err
    return err[0]


@pytest.mark.parametrize(
    "case", ["no_tokenizer", "tokenizer_dir_without_files", "line_without_completion", "too_long", "mesh"]
)
def test_bad_input_gives_one_clear_error(case, workdir, tmp_path, capsys):
    base = [
        "train",
        "--config",
        "tiny",
        "--tokenizer",
        str(workdir / "tokenizer"),
        "--data",
        str(workdir / "train.jsonl"),
        "--out-dir",
        str(tmp_path / "run"),
        "--seq-len",
        "32",
        "--response-len",
        "16",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--samples",
        "0",
    ]
    if case == "no_tokenizer":
        argv, message = (
            [a for a in base if a not in ("--tokenizer", str(workdir / "tokenizer"))],
            "--config tiny trains from scratch and needs --tokenizer DIR",
        )
    elif case == "tokenizer_dir_without_files":
        (tmp_path / "empty").mkdir()
        argv, message = (
            base + ["--tokenizer", str(tmp_path / "empty")],
            "is not a tokenizer directory: no tokenizer.json",
        )
    elif case == "line_without_completion":
        data = tmp_path / "bad.jsonl"
        data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"question": "a"}) + "\n")
        argv, message = (
            base + ["--data", str(data)],
            f'{data}:2: expected {{"prompt": str, "completion": str}} or {{"messages": [...]}}, got [\'question\']',
        )
    elif case == "too_long":
        data = tmp_path / "long.jsonl"
        data.write_text(json.dumps({"prompt": "sort " + "1" * 40 + "=", "completion": "1"}) + "\n")
        argv, message = base + ["--data", str(data)], "does not fit the context seq_len=32"
    else:
        argv, message = base + ["--mesh", "3,1,1"], "--mesh '3,1,1': expected DATA,FSDP,MODEL sizes covering 1 devices"
    assert message in _cli_error(capsys, argv)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_export_and_tokenizer_input(tmp_path, capsys):
    assert "no config.json" in _cli_error(capsys, ["export", str(tmp_path), "--output", str(tmp_path / "x")])
    assert f"{tmp_path / 'none.txt'}: no such file" in _cli_error(
        capsys, ["tokenizer", "--input", str(tmp_path / "none.txt"), "--output", str(tmp_path / "tok")]
    )
