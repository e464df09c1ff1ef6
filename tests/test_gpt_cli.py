"""`jaxport gpt prepare | train | sample` end to end, and clear errors for bad input."""

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxport import cli, gpt
from jaxport.checkpoint import load_torch_file, save_torch_file
from jaxport.errors import JaxportError
from jaxport.gpt import cli as gpt_cli
from jaxport.gpt.model import load_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "gpt"
README_CPU = [
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]


pytestmark = pytest.mark.usefixtures("keep_malloc_defaults")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with data/shakespeare_char prepared by the CLI."""
    root = tmp_path_factory.mktemp("gptcli")
    assert (
        gpt_cli.main(
            [
                "prepare",
                "shakespeare_char",
                "--input",
                str(FIXTURES / "tinyshakespeare" / "input.txt"),
                "--out_dir",
                str(root / "data" / "shakespeare_char"),
            ]
        )
        == 0
    )
    return root


@pytest.mark.slow
def test_readme_cpu_config_trains_resumes_and_samples(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    short = ["--max_iters=4", "--eval_interval=2", "--eval_iters=2", "--progress=False"]
    assert gpt_cli.main(["train", "config/train_shakespeare_char.py", *README_CPU, *short]) == 0
    out = capsys.readouterr().out
    assert (
        "found vocab_size = 65" in out and "iter 4: loss" in out and "saving checkpoint to out-shakespeare-char" in out
    )
    ckpt = load_torch_file(workdir / "out-shakespeare-char" / "ckpt.pt")
    assert ckpt["iter_num"] == 4 and ckpt["model_args"] == dict(
        n_layer=4, n_head=4, n_embd=128, block_size=64, bias=False, vocab_size=65, dropout=0.0
    )
    assert ckpt["config"]["batch_size"] == 12 and ckpt["config"]["dataset"] == "shakespeare_char"
    records = [
        json.loads(line) for line in (workdir / "out-shakespeare-char" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["loss"] for r in records if "loss" in r]
    assert (
        len(losses) == 5 and losses[-1] < losses[0] and all(np.isfinite(r["grad_norm"]) for r in records if "loss" in r)
    )

    # resume continues at iter_num 4 with the saved AdamW state
    assert (
        gpt_cli.main(
            [
                "train",
                "train_shakespeare_char",
                *README_CPU,
                "--init_from=resume",
                "--max_iters=6",
                "--eval_interval=2",
                "--eval_iters=2",
                "--progress=False",
            ]
        )
        == 0
    )
    assert "iter 5: loss" in capsys.readouterr().out
    resumed = load_torch_file(workdir / "out-shakespeare-char" / "ckpt.pt")
    assert resumed["iter_num"] == 6 and float(resumed["optimizer"]["state"][0]["step"]) == 6.0

    assert (
        gpt_cli.main(
            [
                "sample",
                "--out_dir=out-shakespeare-char",
                "--device=cpu",
                "--num_samples=2",
                "--max_new_tokens=70",
                "--start=ROMEO:",
                "--seed=3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("Loading meta from data/shakespeare_char/meta.pkl...\n")
    samples = out.split("\n", 1)[1].split("---------------\n")
    assert len(samples) == 3 and samples[2] == "" and samples[0] != samples[1]
    assert all(s.startswith("ROMEO:") and len(s) == len("ROMEO:") + 70 + 1 for s in samples[:2])


@pytest.mark.slow
def test_finetune_gpt2_from_local_hf_folder(tmp_path, monkeypatch, capsys):
    """finetune_shakespeare's recipe on the tiny GPT-2 fixture: from_pretrained, block cropped to 32."""
    (tmp_path / "gpt2dir").mkdir()
    (tmp_path / "gpt2dir" / "gpt2-xl").symlink_to(FIXTURES / "hf_gpt2_tiny" / "hf")
    monkeypatch.setenv("JAXPORT_GPT2_DIR", str(tmp_path / "gpt2dir"))
    (tmp_path / "data" / "shakespeare").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):  # BPE-style data: no meta.pkl, ids below the model's vocab of 96
        rng.integers(0, 96, 4000).astype(np.uint16).tofile(tmp_path / "data" / "shakespeare" / f"{split}.bin")
    monkeypatch.chdir(tmp_path)
    assert (
        gpt_cli.main(
            [
                "train",
                "finetune_shakespeare",
                "--device=cpu",
                "--block_size=32",
                "--batch_size=2",
                "--gradient_accumulation_steps=2",
                "--max_iters=2",
                "--eval_interval=2",
                "--eval_iters=1",
                "--always_save_checkpoint=True",
                "--progress=False",
            ]
        )
        == 0
    )
    assert "iter 1: loss" in capsys.readouterr().out
    ckpt = load_torch_file(tmp_path / "out-shakespeare" / "ckpt.pt")
    assert ckpt["model_args"] == dict(
        n_layer=2, n_head=2, n_embd=32, block_size=32, bias=True, vocab_size=96, dropout=0.0
    )
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == 3e-5  # decay_lr=False: constant learning rate
    tuned = gpt.GPT.from_checkpoint(tmp_path / "out-shakespeare")
    assert tuned.wpe.shape == (32, 32)
    # eval_gpt2_xl: evaluate the pretrained model once, train nothing
    assert (
        gpt_cli.main(
            [
                "train",
                "eval_gpt2_xl",
                "--dataset=shakespeare",
                "--device=cpu",
                "--block_size=32",
                "--batch_size=2",
                "--eval_iters=2",
                "--out_dir=out-eval",
                "--progress=False",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "step 0: train loss" in out and "iter 0:" not in out and not (tmp_path / "out-eval" / "ckpt.pt").exists()


@pytest.mark.slow
def test_sample_py_greedy_text(tmp_path, monkeypatch, capsys):
    case_dir = FIXTURES / "nanogpt_ckpt"
    e, x = np.load(case_dir / "expected.npz"), np.load(case_dir / "inputs.npz")
    (tmp_path / "out").mkdir()
    (tmp_path / "data" / "tinychar").mkdir(parents=True)
    shutil.copy(case_dir / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    shutil.copy(case_dir / "meta.pkl", tmp_path / "data" / "tinychar" / "meta.pkl")
    meta = pickle.loads((case_dir / "meta.pkl").read_bytes())
    (tmp_path / "prompt.txt").write_text("".join(meta["itos"][i] for i in x["prompt"][0]))
    monkeypatch.chdir(tmp_path)
    assert (
        cli.main(
            [
                "gpt",
                "sample",
                "--start=FILE:prompt.txt",
                "--num_samples=1",
                "--max_new_tokens=24",
                "--temperature=1.0",
                "--top_k=1",
                "--device=cpu",
                "--dtype=float32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Loading meta from data/tinychar/meta.pkl" in out
    assert (
        out.split("Loading meta from data/tinychar/meta.pkl...\n", 1)[1]
        == str(e["sample_py_greedy_text"]) + "\n---------------\n"
    )


@pytest.mark.parametrize(
    "preset, expected",
    [
        (
            "train_shakespeare_char",
            dict(dataset="shakespeare_char", n_layer=6, block_size=256, dropout=0.2, beta2=0.99),
        ),
        (
            "train_gpt2",
            dict(gradient_accumulation_steps=40, batch_size=12, block_size=1024, wandb_run_name="gpt2-124M"),
        ),
        ("finetune_shakespeare", dict(init_from="gpt2-xl", dataset="shakespeare", decay_lr=False, learning_rate=3e-5)),
        ("eval_gpt2", dict(init_from="gpt2", eval_only=True, eval_iters=500)),
        ("eval_gpt2_medium", dict(init_from="gpt2-medium")),
        ("eval_gpt2_large", dict(init_from="gpt2-large")),
        ("eval_gpt2_xl", dict(init_from="gpt2-xl")),
    ],
)
def test_presets_mirror_nanogpt_configs(preset, expected):
    from jaxport.gpt.configurator import configure
    from jaxport.gpt.settings import DEFAULTS, EXTRA

    cfg = configure([f"config/{preset}.py", "--max_iters=7"], {**DEFAULTS, **EXTRA})
    assert {k: cfg[k] for k in expected} == expected and cfg["max_iters"] == 7  # flags after the file win


# -- bad input -----------------------------------------------------------------------------------


def test_unknown_flag_lists_close_matches(capsys, tmp_path):
    assert cli.main(["gpt", "train", "--lerning_rate=1e-3"]) == 1
    assert (
        capsys.readouterr().err.strip()
        == "jaxport gpt: error: unknown flag --lerning_rate; did you mean --learning_rate?"
    )
    with pytest.raises(JaxportError, match=r"unknown flag --temprature; did you mean --temperature\?"):
        gpt_cli.main(["sample", "--temprature=0.5"])
    with pytest.raises(JaxportError, match=r"unknown flag --inptu; did you mean --input\?"):
        gpt_cli.main(["prepare", "shakespeare_char", "--inptu=x.txt"])
    with pytest.raises(
        JaxportError, match=r"config file not found: train_shakespeare_chr; did you mean train_shakespeare_char"
    ):
        gpt_cli.main(["train", "train_shakespeare_chr"])
    with pytest.raises(JaxportError, match=r"--dropout=lots: expected a float"):
        gpt_cli.main(["train", "--dropout=lots"])
    with pytest.raises(JaxportError, match=r"unknown action 'smaple'; did you mean 'sample'\?"):
        gpt_cli.main(["smaple"])
    (tmp_path / "my_config.py").write_text("batch_size = 4\nn_layers = 2\n")
    with pytest.raises(JaxportError, match=r"unknown key in .*my_config.py: --n_layers; did you mean --n_layer\?"):
        gpt_cli.main(["train", str(tmp_path / "my_config.py")])


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(JaxportError, match=r"checkpoint not found: .*run/ckpt.pt"):
        gpt.GPT.from_checkpoint(tmp_path / "run")
    good = (FIXTURES / "nanogpt_ckpt" / "ckpt.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(good[: len(good) // 2])
    with pytest.raises(JaxportError, match=r"truncated or not a PyTorch checkpoint.*cut.pt"):
        gpt.GPT.from_checkpoint(tmp_path / "cut.pt")
    save_torch_file({"weights": np.zeros(3, np.float32)}, tmp_path / "other.pt")
    with pytest.raises(
        JaxportError,
        match=r"other.pt is not a nanoGPT ckpt.pt: expected keys 'model' and 'model_args', found \['weights'\]",
    ):
        gpt.GPT.from_checkpoint(tmp_path / "other.pt")
    ckpt = load_torch_file(FIXTURES / "nanogpt_ckpt" / "ckpt.pt")
    ckpt["model"]["transformer.h.1.mlp.c_fc.weight"] = np.zeros((64, 32), np.float32)
    save_torch_file(ckpt, tmp_path / "shape.pt")
    with pytest.raises(
        JaxportError, match=r"transformer.h.1.mlp.c_fc.weight has shape \[64, 32\], the model expects \[128, 32\]"
    ):
        gpt.GPT.from_checkpoint(tmp_path / "shape.pt")
    del ckpt["model"]["transformer.h.1.mlp.c_fc.weight"]
    save_torch_file(ckpt, tmp_path / "missing.pt")
    with pytest.raises(JaxportError, match=r"missing \['transformer.h.1.mlp.c_fc.weight'\]"):
        gpt.GPT.from_checkpoint(tmp_path / "missing.pt")


def test_block_size_larger_than_checkpoint(workdir, tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    shutil.copy(FIXTURES / "nanogpt_ckpt" / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    shutil.copytree(workdir / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JaxportError, match=r"block_size=64 is larger than the checkpoint's block_size 32"):
        load_checkpoint("out", block_size=64)
    with pytest.raises(JaxportError, match=r"--block_size=64 is larger than the resume model's block_size 32"):
        gpt_cli.main(
            [
                "train",
                "--device=cpu",
                "--init_from=resume",
                "--dataset=shakespeare_char",
                "--block_size=64",
                "--progress=False",
            ]
        )


def test_vocab_mismatch_between_meta_and_checkpoint(workdir, tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    shutil.copy(FIXTURES / "nanogpt_ckpt" / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    (tmp_path / "data").mkdir()
    shutil.copytree(workdir / "data" / "shakespeare_char", tmp_path / "data" / "tinychar")  # 65 chars, not 59
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        JaxportError,
        match=r"vocab mismatch: data/tinychar/meta.pkl has vocab_size 65 but the "
        r"checkpoint's model has vocab_size 59",
    ):
        gpt_cli.main(["sample", "--device=cpu", "--num_samples=1", "--max_new_tokens=2"])
    with pytest.raises(JaxportError, match=r"meta.pkl says vocab_size 65 but the resume model has vocab_size 59"):
        gpt_cli.main(
            ["train", "--device=cpu", "--init_from=resume", "--dataset=tinychar", "--block_size=32", "--progress=False"]
        )
