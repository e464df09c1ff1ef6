"""Every bad value named: a table of bad inputs to the three families, each run as a user runs it (the
`jaxport` command in its own process), each expected to end with exit status 1 and ONE line
`jaxport <family>: error: ...` naming the file or key, the value and what is expected (no traceback),
and to leave the run folder it was pointed at as it was. A full disk is a file-size limit (RLIMIT_FSIZE)
set in the child, whose writes then fail with EFBIG, from Python, numpy, torch and orbax's C++ alike.

The cases run two at a time (this machine has two cores); each gets its own copy of what it may break.
"""

import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
DREAM_MODEL = FIXTURES / "dream" / "tiny_sharded" / "model"
TRM_TINY = [
    "arch.mlp_t=True",
    "arch.pos_encodings=none",
    "arch.hidden_size=32",
    "arch.num_heads=2",
    "arch.H_cycles=1",
    "arch.L_cycles=1",
    "arch.L_layers=1",
    "arch.halt_max_steps=2",
    "arch.puzzle_emb_len=1",
    "arch.forward_dtype=float32",
    "global_batch_size=16",
    "evaluators=[]",
    "epochs=20",
    "eval_interval=10",
]
GPT_TINY = [
    "--device=cpu",
    "--dataset=shakespeare_char",
    "--block_size=32",
    "--batch_size=4",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=32",
    "--gradient_accumulation_steps=1",
    "--eval_iters=1",
    "--progress=False",
]
DREAM_TRAIN = [
    "dream",
    "train",
    "--model",
    str(DREAM_MODEL),
    "--data",
    "{case}/sft.jsonl",
    "--seq-len",
    "24",
    "--batch-size",
    "4",
    "--samples",
    "0",
]
TIMEOUT = 300
# The file-size limit is set between fork and exec (preexec_fn); JAX, when another test module has loaded it,
# warns about forking. The child only calls signal.signal and setrlimit (already imported) before exec.
pytestmark = pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")


@dataclasses.dataclass
class Case:
    argv: list[str]  # after `jaxport`; {data} {gdata} {run} {case} {file} {model} are filled in
    expect: list[str]  # what the error line must name
    prepare: Callable[[Path], None] | None = None  # breaks an input inside the case's own folder
    run: str | None = None  # "trm" or "gpt": the case gets its own copy of a finished run of that family as {run}
    untouched: tuple[str, ...] = ("",)  # parts of {run} (or of the case's folder) that must stay as they were
    devices: int = 1
    file_size_limit: int | None = None  # bytes: writes beyond fail with EFBIG, as on a full disk


# ----- inputs the cases break


def truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def broken_trm_data(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def prepare(case: Path) -> None:
        shutil.copytree(case.parent / "shared" / "sudoku", case / "data")
        edit(case / "data" / "train")

    return prepare


def drop_rows(name: str, rows: int) -> Callable[[Path], None]:
    return lambda split: np.save(split / name, np.load(split / name)[:-rows])


def gpt_data(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    """{case}/data/shakespeare_char: the shared GPT data, broken by `edit`."""

    def prepare(case: Path) -> None:
        shutil.copytree(case.parent / "shared" / "data", case / "data")
        edit(case / "data" / "shakespeare_char")

    return prepare


def other_vocabulary(case: Path) -> None:
    """{case}/other/shakespeare_char/meta.pkl: a 59-character vocabulary (the run's has 65)."""
    shutil.copytree(case.parent / "shared" / "data", case / "other")
    shutil.copy(FIXTURES / "gpt" / "nanogpt_ckpt" / "meta.pkl", case / "other" / "shakespeare_char" / "meta.pkl")


def dream_model(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def prepare(case: Path) -> None:
        shutil.copytree(DREAM_MODEL, case / "model")
        edit(case / "model")

    return prepare


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def sft_data(case: Path) -> None:
    (case / "sft.jsonl").write_text(
        "".join(json.dumps({"prompt": f"add {i}+{i}=", "completion": str(2 * i)}) + "\n" for i in range(16))
    )


def empty_folder(case: Path) -> None:
    (case / "empty").mkdir()


UNDER_A_FILE = "is a file, not a folder"
FULL_DISK = "size limit; free some space or write elsewhere"
CASES = {
    # ----- TRM: the run config (Hydra overrides into pydantic), pointed at an existing run folder
    "trm/hidden_size_not_an_integer": Case(
        ["trm", "train", *TRM_TINY, "arch.hidden_size=abc", "data_paths=[{data}]", "checkpoint_path={run}"],
        ["arch.hidden_size='abc'", "valid integer"],
        run="trm",
    ),
    "trm/negative_lr": Case(
        ["trm", "train", *TRM_TINY, "lr=-1", "data_paths=[{data}]", "checkpoint_path={run}"],
        ["lr=-1", "greater than or equal to 0"],
        run="trm",
    ),
    "trm/batch_not_divisible_by_8_devices": Case(
        ["trm", "train", *TRM_TINY, "global_batch_size=12", "data_paths=[{data}]", "checkpoint_path={run}"],
        ["global_batch_size=12 is not divisible by the 8 devices", "use a multiple of 8"],
        run="trm",
        devices=8,
    ),
    "trm/hidden_size_not_divisible_by_heads": Case(
        [
            "trm",
            "train",
            *TRM_TINY,
            "arch.hidden_size=30",
            "arch.num_heads=4",
            "data_paths=[{data}]",
            "checkpoint_path={run}",
        ],
        ["arch.hidden_size 30 is not divisible by arch.num_heads 4"],
        run="trm",
    ),
    "trm/halt_max_steps_zero": Case(
        ["trm", "train", *TRM_TINY, "arch.halt_max_steps=0", "data_paths=[{data}]", "checkpoint_path={run}"],
        ["arch.halt_max_steps=0", "greater than 0"],
        run="trm",
    ),
    "trm/epochs_not_a_multiple_of_eval_interval": Case(
        ["trm", "train", *TRM_TINY, "epochs=10", "eval_interval=3", "data_paths=[{data}]", "checkpoint_path={run}"],
        ["epochs (10) must be a multiple of eval_interval (3)"],
        run="trm",
    ),
    "trm/unknown_forward_dtype": Case(
        ["trm", "train", *TRM_TINY, "arch.forward_dtype=float64", "data_paths=[{data}]", "checkpoint_path={run}"],
        ["arch.forward_dtype='float64'", "'float32', 'bfloat16' or 'float16'"],
        run="trm",
    ),
    "trm/resume_with_another_hidden_size": Case(
        ["trm", "train", *TRM_TINY, "arch.hidden_size=64", "data_paths=[{data}]", "checkpoint_path={run}"],
        ["checkpoint step 1", "does not fit this model/config", "has shape [32, 256], the model expects [64, 256]"],
        run="trm",
    ),
    # ----- TRM: dataset arrays
    "trm/truncated_inputs_npy": Case(
        ["trm", "train", *TRM_TINY, "data_paths=[{case}/data]", "checkpoint_path={run}"],
        ["all__inputs.npy", "not a readable .npy array (truncated?)", "build the dataset again"],
        prepare=broken_trm_data(lambda split: truncate(split / "all__inputs.npy")),
        run="trm",
    ),
    "trm/labels_fewer_rows_than_inputs": Case(
        ["trm", "train", *TRM_TINY, "data_paths=[{case}/data]", "checkpoint_path={run}"],
        ["all__labels.npy has 45 rows but inputs.npy has 48"],
        prepare=broken_trm_data(drop_rows("all__labels.npy", 3)),
        run="trm",
    ),
    "trm/puzzle_identifiers_one_short": Case(
        ["trm", "train", *TRM_TINY, "data_paths=[{case}/data]", "checkpoint_path={run}"],
        ["all__puzzle_identifiers.npy has 47 entries, expected one per puzzle (48)"],
        prepare=broken_trm_data(drop_rows("all__puzzle_identifiers.npy", 1)),
        run="trm",
    ),
    "trm/dataset_json_not_json": Case(
        ["trm", "train", *TRM_TINY, "data_paths=[{case}/data]", "checkpoint_path={run}"],
        ["train/dataset.json is not valid JSON"],
        prepare=broken_trm_data(lambda split: truncate(split / "dataset.json", keep=20)),
        run="trm",
    ),
    # ----- TRM: outputs
    "trm/build_output_under_a_file": Case(
        ["trm", "build", "sudoku", "--generate", "--num-train", "4", "--num-test", "2", "--output-dir", "{file}/ds"],
        ["cannot create {file}/ds", UNDER_A_FILE],
    ),
    "trm/checkpoint_path_under_a_file": Case(
        ["trm", "train", *TRM_TINY, "data_paths=[{data}]", "checkpoint_path={file}/run"],
        ["cannot create {file}/run", UNDER_A_FILE],
    ),
    "trm/full_disk_while_saving_a_checkpoint": Case(
        ["trm", "train", *TRM_TINY, "data_paths=[{data}]", "checkpoint_path={run}", "max_steps=2"],
        ["saving checkpoint step 2 failed", FULL_DISK, "intact (newest: step 1)"],
        run="trm",
        untouched=("jaxport_checkpoints/1",),
        file_size_limit=100_000,
    ),
    "trm/eval_of_a_folder_without_config": Case(
        ["trm", "eval", "--run", "{case}/empty"],
        ["config file not found: {case}/empty/all_config.yaml"],
        prepare=empty_folder,
    ),
    # ----- GPT: flags and config files, pointed at an existing run folder
    "gpt/negative_learning_rate": Case(
        [
            "gpt",
            "train",
            *GPT_TINY,
            "--data_dir={gdata}",
            "--out_dir={run}",
            "--init_from=resume",
            "--learning_rate=-1",
        ],
        ["learning_rate=-1.0", "greater than or equal to 0"],
        run="gpt",
    ),
    "gpt/learning_rate_not_a_number": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={gdata}", "--out_dir={run}", "--learning_rate=abc"],
        ["--learning_rate=abc: expected a float"],
        run="gpt",
    ),
    "gpt/dropout_out_of_range": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={gdata}", "--out_dir={run}", "--dropout=1.5"],
        ["dropout=1.5", "less than 1"],
        run="gpt",
    ),
    "gpt/accumulation_not_divisible_by_8_devices": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={gdata}", "--out_dir={run}", "--gradient_accumulation_steps=4"],
        ["gradient_accumulation_steps=4 must be a multiple of the 8 devices"],
        run="gpt",
        devices=8,
    ),
    "gpt/n_embd_not_divisible_by_heads": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={gdata}", "--out_dir={run}", "--n_embd=30", "--n_head=4"],
        ["n_embd=30 is not divisible by n_head=4"],
        run="gpt",
    ),
    "gpt/cosine_decay_ends_before_warmup": Case(
        [
            "gpt",
            "train",
            *GPT_TINY,
            "--data_dir={gdata}",
            "--out_dir={run}",
            "--warmup_iters=10",
            "--lr_decay_iters=10",
        ],
        ["lr_decay_iters (10) must be larger than warmup_iters (10)"],
        run="gpt",
    ),
    # ----- GPT: data folders and meta.pkl
    "gpt/train_bin_shorter_than_block_size": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={case}/data", "--out_dir={run}"],
        ["train.bin holds 20 ids, fewer than block_size + 1 = 33"],
        prepare=gpt_data(lambda d: truncate(d / "train.bin", keep=40)),
        run="gpt",
    ),
    "gpt/train_bin_cut_mid_id": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={case}/data", "--out_dir={run}"],
        ["train.bin has 20001 bytes, not a whole number of 2-byte (uint16) ids"],
        prepare=gpt_data(lambda d: truncate(d / "train.bin", keep=20001)),
        run="gpt",
    ),
    "gpt/meta_pkl_not_a_pickle": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={case}/data", "--out_dir={run}"],
        ["meta.pkl is not a nanoGPT meta.pkl"],
        prepare=gpt_data(lambda d: (d / "meta.pkl").write_text("garbage")),
        run="gpt",
    ),
    "gpt/sample_with_another_vocabulary": Case(
        [
            "gpt",
            "sample",
            "--device=cpu",
            "--out_dir={run}",
            "--data_dir={case}/other",
            "--num_samples=1",
            "--max_new_tokens=4",
        ],
        ["vocab mismatch", "other/shakespeare_char/meta.pkl has vocab_size 59", "model has vocab_size 65"],
        prepare=other_vocabulary,
        run="gpt",
    ),
    "gpt/resume_with_another_vocabulary": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={case}/other", "--out_dir={run}", "--init_from=resume"],
        ["meta.pkl says vocab_size 59", "model has vocab_size 65"],
        prepare=other_vocabulary,
        run="gpt",
    ),
    "gpt/sample_at_temperature_zero": Case(
        ["gpt", "sample", "--device=cpu", "--out_dir={run}", "--data_dir={gdata}", "--temperature=0"],
        ["temperature=0.0", "greater than 0"],
        run="gpt",
    ),
    "gpt/missing_tokenizer_file": Case(
        [
            "gpt",
            "prepare",
            "shakespeare",
            "--input",
            str(FIXTURES / "gpt" / "tinyshakespeare" / "input.txt"),
            "--out_dir",
            "{case}/bpe",
            "--tokenizer_dir",
            "{case}/empty",
        ],
        ["GPT-2 tokenizer file missing: {case}/empty/"],
        prepare=empty_folder,
    ),
    # ----- GPT: outputs
    "gpt/prepare_output_under_a_file": Case(
        [
            "gpt",
            "prepare",
            "shakespeare_char",
            "--input",
            str(FIXTURES / "gpt" / "tinyshakespeare" / "input.txt"),
            "--out_dir",
            "{file}/data",
        ],
        ["cannot create {file}/data", UNDER_A_FILE],
    ),
    "gpt/out_dir_under_a_file": Case(
        ["gpt", "train", *GPT_TINY, "--data_dir={gdata}", "--out_dir={file}/run"],
        ["cannot create {file}/run", UNDER_A_FILE],
    ),
    "gpt/full_disk_while_writing_ckpt_pt": Case(
        [
            "gpt",
            "train",
            *GPT_TINY,
            "--data_dir={gdata}",
            "--out_dir={run}",
            "--init_from=resume",
            "--max_iters=4",
            "--eval_interval=4",
        ],
        ["cannot write {run}/ckpt.pt", FULL_DISK],
        run="gpt",
        untouched=("ckpt.pt", "jaxport_checkpoints/2"),
        file_size_limit=150_000,
    ),
    "gpt/full_disk_while_preparing": Case(
        [
            "gpt",
            "prepare",
            "shakespeare_char",
            "--input",
            str(FIXTURES / "gpt" / "tinyshakespeare" / "input.txt"),
            "--out_dir",
            "{case}/data",
        ],
        ["cannot write {case}/data/train.bin", FULL_DISK],
        file_size_limit=100_000,
    ),
    # ----- Dream
    "dream/prompt_longer_than_max_position_embeddings": Case(
        [
            "dream",
            "generate",
            "--model",
            "{case}/model",
            "--prompt",
            "def add(a, b): return a + b, " * 3,
            "--max-new-tokens",
            "8",
            "--dtype",
            "float32",
        ],
        ["max_position_embeddings (16, config.json)", "need", "positions"],
        prepare=dream_model(lambda m: edit_json(m / "config.json", max_position_embeddings=16)),
    ),
    "dream/zero_steps": Case(
        [
            "dream",
            "generate",
            "--model",
            "{model}",
            "--prompt",
            "def add(a, b):",
            "--max-new-tokens",
            "8",
            "--steps",
            "0",
            "--dtype",
            "float32",
        ],
        ["steps: must be a positive integer, got 0"],
    ),
    "dream/top_p_above_one": Case(
        [
            "dream",
            "generate",
            "--model",
            "{model}",
            "--prompt",
            "x",
            "--max-new-tokens",
            "8",
            "--top-p",
            "1.5",
            "--dtype",
            "float32",
        ],
        ["top_p: must be in (0, 1], got 1.5"],
    ),
    "dream/missing_tokenizer_files": Case(
        ["dream", "generate", "--model", "{case}/model", "--prompt", "x", "--max-new-tokens", "8"],
        ["{case}/model has neither tokenizer.json nor vocab.json"],
        prepare=dream_model(lambda m: [(m / name).unlink() for name in ("tokenizer.json", "vocab.json")]),
    ),
    "dream/missing_weight_shard": Case(
        ["dream", "generate", "--model", "{case}/model", "--prompt", "x", "--max-new-tokens", "8"],
        ["missing shard {case}/model/model-00002-of-00004.safetensors", "model.safetensors.index.json"],
        prepare=dream_model(lambda m: (m / "model-00002-of-00004.safetensors").unlink()),
    ),
    "dream/export_output_under_a_file": Case(
        ["dream", "export", "{model}", "--output", "{file}/hf"], ["cannot create {file}/hf", UNDER_A_FILE]
    ),
    "dream/train_out_dir_under_a_file": Case(
        [*DREAM_TRAIN, "--out-dir", "{file}/run", "--steps", "1"],
        ["cannot create {file}/run", UNDER_A_FILE],
        prepare=sft_data,
    ),
    "dream/full_disk_while_saving_a_checkpoint": Case(
        [*DREAM_TRAIN, "--out-dir", "{case}/run", "--steps", "2", "--save-every", "1"],
        ["saving checkpoint step 1 failed", FULL_DISK, "holds no complete checkpoint"],
        prepare=sft_data,
        untouched=("sft.jsonl",),
        file_size_limit=200_000,
    ),
}


# ----- running them


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its modification time and contents."""
    if folder.is_file():
        return {"": (folder.stat().st_mtime_ns, folder.read_bytes())}
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def limit_file_size(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def run_all(commands: dict[str, dict], workers: int = 2) -> dict[str, subprocess.CompletedProcess]:
    """Run `commands` (name -> Popen keywords, with `log`: the file stderr goes to), at most `workers` at a
    time, without threads (so preexec_fn is safe); returns each one's exit status and stderr."""
    pending, running, done = list(commands), {}, {}
    while pending or running:
        while pending and len(running) < workers:
            name = pending.pop(0)
            spec = dict(commands[name])
            log = open(spec.pop("log"), "w+")
            running[name] = (subprocess.Popen(stdout=subprocess.DEVNULL, stderr=log, **spec), log, time.monotonic())
        for name, (proc, log, started) in list(running.items()):
            if proc.poll() is None and time.monotonic() - started < TIMEOUT:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, "", log.read())
            log.close()
            del running[name]
        time.sleep(0.02)
    return done


def jaxport_command(argv: list[str], devices: int = 1, **popen) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return {"args": [sys.executable, "-m", "jaxport.cli", *argv], "env": env, **popen}


def finished_runs(shared: Path) -> None:
    """A TRM dataset and a GPT data folder, then a 1-step TRM run and a 2-iteration GPT run on them."""
    first = {
        "sudoku": jaxport_command(
            [
                "trm",
                "build",
                "sudoku",
                "--generate",
                "--num-train",
                "48",
                "--num-test",
                "4",
                "--givens",
                "60",
                "--output-dir",
                str(shared / "sudoku"),
            ],
            log=shared / "sudoku.log",
        ),
        "data": jaxport_command(
            [
                "gpt",
                "prepare",
                "shakespeare_char",
                "--input",
                str(FIXTURES / "gpt" / "tinyshakespeare" / "input.txt"),
                "--out_dir",
                str(shared / "data" / "shakespeare_char"),
            ],
            log=shared / "data.log",
        ),
    }
    for name, result in run_all(first).items():
        assert result.returncode == 0, (name, result.stderr[-2000:])
    shutil.rmtree(shared / "sudoku" / "test")  # training only: no evaluation
    second = {
        "trm": jaxport_command(
            [
                "trm",
                "train",
                *TRM_TINY,
                f"data_paths=[{shared / 'sudoku'}]",
                f"checkpoint_path={shared / 'trm'}",
                "max_steps=1",
            ],
            log=shared / "trm.log",
        ),
        "gpt": jaxport_command(
            [
                "gpt",
                "train",
                *GPT_TINY,
                f"--data_dir={shared / 'data'}",
                f"--out_dir={shared / 'gpt'}",
                "--max_iters=2",
                "--eval_interval=2",
            ],
            log=shared / "gpt.log",
        ),
    }
    for name, result in run_all(second).items():
        assert result.returncode == 0, (name, result.stderr[-2000:])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bad_input")
    shared = root / "shared"
    shared.mkdir()
    finished_runs(shared)
    (root / "a_file").write_text("a regular file, where the command expects a folder\n")
    commands, before, folders = {}, {}, {}
    for name, case in CASES.items():
        folder = root / name.replace("/", "-")
        folder.mkdir()
        places = {
            "data": shared / "sudoku",
            "gdata": shared / "data",
            "case": folder,
            "file": root / "a_file",
            "model": DREAM_MODEL,
            "run": folder / "run",
        }
        if case.run:
            shutil.copytree(shared / case.run, folder / "run")
        if case.prepare:
            case.prepare(folder)
        watched = [(folder / "run" if case.run else folder) / part for part in case.untouched]
        before[name], folders[name] = [snapshot(w) for w in watched], (places, watched)
        popen = {"preexec_fn": limit_file_size(case.file_size_limit)} if case.file_size_limit else {}
        commands[name] = jaxport_command(
            [arg.format(**places) for arg in case.argv], case.devices, log=folder.with_suffix(".log"), **popen
        )
    done = run_all(commands)
    return {name: (done[name], before[name], *folders[name]) for name in CASES}


def test_the_table_covers_the_issue():
    assert len(CASES) >= 30
    assert {name.split("/")[0] for name in CASES} == {"trm", "gpt", "dream"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_clear_error(name, results):
    result, before, places, watched = results[name]
    family = name.split("/")[0]
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"jaxport {family}: error: ")]
    assert result.returncode == 1 and "Traceback" not in result.stderr and len(errors) == 1, result.stderr[-3000:]
    assert lines[-1] == errors[0], "the error is the last thing said"
    for expected in CASES[name].expect:
        assert expected.format(**places) in errors[0], errors[0]
    for folder, files in zip(watched, before):
        assert snapshot(folder) == files, f"{folder} changed"
