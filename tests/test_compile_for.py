"""`--compile-for SLICE`: each family's real step compiled for a small TPU slice on this CPU, through the real CLI,
with a report whose numbers hold together (memory positive and below the chip's HBM, FLOPs within 10% of the
model's analytic count for a step without loops, the runtime's attention and remat named); a program too large for
the chip names a mesh that fits and exits with DOES_NOT_FIT; the slice names, a missing libtpu and a generation
libtpu refuses each get one clear line."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxport.errors import JaxportError
from jaxport.nn import swiglu_intermediate_size
from jaxport.runtime import compile_for, hlo, topologies

FIXTURES = Path(__file__).parent / "fixtures"
TINY_DREAM = FIXTURES / "dream" / "tiny_sharded" / "model"
UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
needs_libtpu = pytest.mark.skipif(compile_for.libtpu_version() is None, reason="libtpu is not installed")


def jaxport(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxport.cli", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def reports(stdout: str) -> list[dict]:
    """The numbers of each report in `stdout`: memory needed and HBM per device, FLOPs per device."""
    found = []
    for block in re.split(r"\n(?=jaxport )", stdout.strip()):  # each report starts with its title
        need = re.search(
            r"needs (?:at least )?([\d.]+) (B|KiB|MiB|GiB) per device of a \w+ device's ([\d.]+) GiB", block
        )
        flops = re.search(r"FLOPs +([\d.]+) ([kMGTP]?)FLOP per device", block)
        found.append(
            {
                "needed": float(need.group(1)) * BYTES[need.group(2)],
                "hbm": float(need.group(3)) * 2**30,
                "fits": "fits (" in block,
                "flops": float(flops.group(1)) * UNITS[flops.group(2)] if flops else None,
                "text": block,
            }
        )
    return found


def check(proc: subprocess.CompletedProcess, analytic_flops: float | None) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (report,) = reports(proc.stdout)
    assert 0 < report["needed"] < report["hbm"] and report["fits"], report["text"]
    assert "roofline" in report["text"] and "collectives" in report["text"]
    assert re.search(r"^  attention    \w+", report["text"], re.M), report["text"]
    assert re.search(r"^  remat        (none|attention_scores|block|save_dots): ", report["text"], re.M)
    if analytic_flops is not None:
        assert report["flops"] == pytest.approx(analytic_flops, rel=0.10), (report["flops"], analytic_flops)
    return report


# -- slice names and the chip table


@pytest.mark.parametrize(
    "name, chips, devices, topology, hbm_gib",
    [
        ("v2-8", 4, 8, "v2:2x2", 8),
        ("v3-8", 4, 8, "v3:2x2", 16),
        ("v4-8", 4, 4, "v4:2x2x1", 32),
        ("v4-64", 32, 32, "v4:2x4x4", 32),
        ("v5e-8", 8, 8, "v5e:2x4", 16),
        ("v5litepod-16", 16, 16, "v5e:4x4", 16),
        ("v5p-64", 32, 32, "v5:2x4x4", 95),
        ("v5p-256", 128, 128, "v5:4x4x8", 95),
        ("v6e-256", 256, 256, "v6e:16x16", 32),
    ],
)
def test_cloud_tpu_slice_names(name, chips, devices, topology, hbm_gib):
    tpu = topologies.parse_slice(name)
    assert (tpu.chips, tpu.devices, tpu.topology) == (chips, devices, topology)
    assert tpu.chip.per_device(tpu.chip.hbm_bytes) == hbm_gib * 2**30


@pytest.mark.parametrize(
    "name, message",
    [("v7-8", "not a Cloud TPU slice name"), ("v4-12", "counts TensorCores, two per chip"), ("tpu", "e.g. v2-8")],
)
def test_a_bad_slice_name_is_one_clear_error(name, message):
    with pytest.raises(JaxportError, match=message):
        topologies.parse_slice(name)


def test_the_flops_line_counts_loops_of_unknown_length_once():
    """A program with many loops of unknown trip count (a scan over layers inside one of known length) says how
    many there are in one clause, and lists the known lengths only."""
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    program = compile_for.Program("a step", None, (), mesh, "no --mesh")
    loops = hlo.HloSummary(collectives=[], loops=[2, *[None] * 190, 1], extra_flops=1e12, extra_traffic_share=0)
    report = compile_for.Report(
        topologies.parse_slice("v5p-64"), program, "0", flops=1e12, hbm_bytes=1e9, hlo=loops, needed=2**30
    )
    line = next(line for line in compile_for.format_report(report).splitlines() if "FLOPs" in line)
    assert "?" not in line
    assert "its loop(s) of 2 iterations added" in line
    assert "190 loop(s) of unknown length counted once" in line


def test_a_report_names_its_attention_and_remat_and_a_refused_programs_arguments():
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    program = compile_for.Program("a step", None, (), mesh, "--fsdp=1")
    tpu = topologies.parse_slice("v5e-8")
    refused = compile_for.Report(tpu, program, "0", attention="splash", remat="block", needed=44 * 2**30)
    refused.refused, refused.argument_bytes = "RESOURCE_EXHAUSTED: Ran out of memory on HBM", 17 * 2**30
    lines = compile_for.format_report(refused).splitlines()
    assert lines[2].startswith("  attention    splash: Pallas's splash-attention kernel")
    assert lines[3] == (
        "  remat        block: the backward pass computes each transformer block again from its input "
        "(--runtime remat=none|attention_scores|block|save_dots)"
    )
    assert "               its arguments take 17 GiB per device, more than the HBM by themselves" in lines
    assert "DOES NOT FIT with --fsdp=1" in lines[-1]


def test_a_program_that_does_not_fit_exits_with_does_not_fit_after_its_report(monkeypatch):
    """The status a job script's pre-flight check reads: 0 where every program fits, DOES_NOT_FIT (not an error's
    1) where one does not, each report printed first."""
    import io

    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    needs = {"small": 2**30, "large": 20 * 2**30}
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # this process's platforms stay as they are
    monkeypatch.setattr(compile_for, "topology_devices", lambda tpu: [None] * tpu.devices)
    monkeypatch.setattr(compile_for, "analyse", lambda tpu, p: compile_for.Report(tpu, p, "0", needed=needs[p.title]))

    def status(*titles):
        out = io.StringIO()
        build = lambda devices: [compile_for.Program(t, None, (), mesh, "--fsdp=1") for t in titles]  # noqa: E731
        return compile_for.compile_for("v5e-8", build, out=out), out.getvalue()

    assert status("small")[0] == 0
    code, printed = status("small", "large")
    assert code == compile_for.DOES_NOT_FIT == 3
    assert printed.count("compiled for a TPU v5e-8") == 2 and "DOES NOT FIT" in printed


def test_programs_that_fit_alone_but_not_held_together_exit_with_does_not_fit(monkeypatch):
    """A server keeps its start-up set compiled at once (`holder`): two programs of 10 GiB per device, 9 GiB of it
    code, each fit a v5e's 16 GiB, but held together they need 1 GiB of buffers and 18 GiB of code."""
    import io

    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    memory = {"arguments": 2**30, "outputs": 0, "aliased": 0, "temporaries": 0, "code": 9 * 2**30}
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # this process's platforms stay as they are
    monkeypatch.setattr(compile_for, "topology_devices", lambda tpu: [None] * tpu.devices)
    monkeypatch.setattr(
        compile_for, "analyse", lambda tpu, p: compile_for.Report(tpu, p, "0", memory=memory, needed=10 * 2**30)
    )

    def status(holder):
        out = io.StringIO()
        build = lambda devices: [compile_for.Program(t, None, (), mesh, "--fsdp=1") for t in ("a", "b")]  # noqa: E731
        return compile_for.compile_for("v5e-4", build, out=out, holder=holder), out.getvalue()

    code, printed = status(None)
    assert code == 0 and "DOES NOT FIT" not in printed and "held at once" not in printed
    code, printed = status("the server")
    assert code == compile_for.DOES_NOT_FIT, printed
    assert printed.rstrip().endswith("needs 19 GiB per device of a v5e device's 16 GiB HBM: DOES NOT FIT"), printed
    assert "the server: its 2 programs held at once" in printed


@needs_libtpu
def test_a_programs_arguments_are_counted_per_device():
    """`argument_bytes`: each abstract array's shard on one device; static arguments count nothing."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(compile_for.topology_devices(topologies.parse_slice("v5e-4"))), ("data",))
    split = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("data")))
    whole = jax.ShapeDtypeStruct((3,), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
    assert compile_for.argument_bytes(({"w": split}, [whole], "static")) == 2 * 16 * 4 + 3 * 2


def test_without_libtpu_the_flag_says_what_to_install(monkeypatch):
    monkeypatch.setattr(compile_for, "libtpu_version", lambda: None)
    with pytest.raises(JaxportError, match=r"libtpu, which is not installed: pip install 'jaxport\[tpu\]'"):
        compile_for.topology_devices(topologies.parse_slice("v4-8"))


@needs_libtpu
def test_a_generation_libtpu_refuses_is_named():
    tpu = topologies.parse_slice("v4-8")
    unknown = topologies.Slice("v99-8", topologies.dataclasses.replace(tpu.chip, topology_name="v99"), tpu.shape)
    with pytest.raises(JaxportError, match=r"libtpu \S+ \(jax \S+\) refuses the v4 topology v99:2x2x1: "):
        compile_for.topology_devices(unknown)


def test_the_models_choose_for_the_target_while_tracing():
    """A program jitted under the slice's runtime makes the target's choices (here XLA:CPU's row-major copies, made
    on a CPU only), whatever machine traces it."""
    import jax
    import jax.numpy as jnp

    from jaxport import runtime
    from jaxport.nn.linear import row_major

    tpu = compile_for.topology_devices(topologies.parse_slice("v5e-4"))
    cpu = jax.devices("cpu")[:1]
    seen = {}

    def probe(a):
        seen[runtime.current().platform] = row_major(a) is a
        return a

    for devices in (tpu, cpu):
        runtime.jit(probe, runtime.for_devices(devices)).trace(jax.ShapeDtypeStruct((4, 4), jnp.bfloat16))
    assert seen == {"tpu": True, "cpu": False}


# -- the compiled program read back


@pytest.mark.slow
@needs_libtpu
def test_loops_collectives_and_flops_read_from_the_compiled_program():
    """A 5-step scan of a sharded product: XLA's cost analysis takes its body once, the report all five times; the
    gradient's all-reduce is found with its group and bytes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    tpu = topologies.parse_slice("v4-8")
    mesh = Mesh(np.array(compile_for.topology_devices(tpu)), ("data",))

    def step(w, x):
        def body(g, x_i):
            return g + jax.grad(lambda w: jnp.sum(jnp.tanh(x_i @ w)))(w), None

        return w - jax.lax.scan(body, jnp.zeros_like(w), x)[0]

    w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    x = jax.ShapeDtypeStruct((5, 64, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "data")))
    program = compile_for.Program("a scan", jax.jit(step), (w, x), mesh, "")
    report = compile_for.analyse(tpu, program)
    per_iteration = 2 * (2 * 16 * 256 * 256)  # per device: 16 rows, the product and its weight gradient
    assert report.flops == pytest.approx(per_iteration, rel=0.10)  # XLA: the body once, its elementwise work too
    assert report.hlo.loops == [5]
    assert report.hlo.extra_flops == 4 * per_iteration  # the products of the other four iterations
    (reduce,) = report.collectives
    assert (reduce.kind, reduce.count, reduce.bytes) == ("all-reduce", 1, 256 * 256 * 4)
    assert reduce.traffic == 2 * 3 / 4 * reduce.bytes  # a ring over 4 devices
    assert 0 < report.needed < report.hbm


@pytest.mark.slow
@needs_libtpu
def test_attention_on_a_tpu_recomputes_its_scores_in_the_backward_pass():
    """A TPU's runtime recomputes each attention's [B, H, S, T] scores in the backward pass instead of keeping them:
    compiled for a v5e chip, four layers' gradient holds fewer temporaries by about three layers' scores (GPT-2
    1.5B's step, docs/tpu.md)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxport import runtime
    from jaxport.nn import dot_product_attention

    B, S, H, D, layers = 4, 1024, 8, 64, 4
    devices = compile_for.topology_devices(topologies.parse_slice("v5e-4"))
    mesh = Mesh(np.array(devices), ("data",))
    qkv = jax.ShapeDtypeStruct((B, S, H, D), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))

    def loss(q, k, v):
        for _ in range(layers):
            q = dot_product_attention(q, k, v, causal=True)
        return jnp.sum(q.astype(jnp.float32) ** 2)

    def temporaries(target):
        gradient = runtime.jit(jax.grad(loss, argnums=(0, 1, 2)), target)
        return gradient.lower(qkv, qkv, qkv).compile().memory_analysis().temp_size_in_bytes

    tpu = dataclasses.replace(runtime.for_devices(devices), attention="xla")  # XLA's ops: what remat applies to
    assert tpu.remat == "attention_scores"
    kept, recomputed = temporaries(dataclasses.replace(tpu, remat="none")), temporaries(tpu)
    scores = B * H * S * S * 4  # float32, one layer's
    assert recomputed <= kept - 2 * scores, (recomputed, kept, scores)


@pytest.mark.slow
@needs_libtpu
def test_block_remat_keeps_each_blocks_input_alone_on_a_tpu():
    """remat=block (`runtime.remat_block`): compiled for a TPU v2 core, the gradient of eight blocks keeps each block's
    input for the backward pass, not its `[N, F]` hidden activations, which none and save_dots (a product's output)
    keep: fewer temporaries than either by more than half the blocks' hidden activations. (A v2 core's compiler
    counts these temporaries from a few MiB; a v5e's counted none short of sixteen blocks of 16 MiB, minutes of
    compiling.)"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxport import runtime

    N, D, F, layers = 1024, 128, 512, 8
    devices = compile_for.topology_devices(topologies.parse_slice("v2-8"))
    whole = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((N, D), jnp.float32, sharding=whole)
    w = jax.ShapeDtypeStruct((layers, 2, D, F), jnp.float32, sharding=whole)

    def loss(w, x):
        for i in range(layers):
            x = runtime.remat_block(lambda x, i=i: x + jnp.tanh(x @ w[i, 0]) @ w[i, 1].T)(x)
        return jnp.sum(x**2)

    def temporaries(remat):
        gradient = runtime.jit(jax.grad(loss), dataclasses.replace(runtime.for_devices(devices), remat=remat))
        return gradient.lower(w, x).compile().memory_analysis().temp_size_in_bytes

    kept, recomputed, dots = (temporaries(remat) for remat in ("none", "block", "save_dots"))
    hidden = N * F * 4  # one block's, float32
    assert recomputed <= min(kept, dots) - layers // 2 * hidden, (recomputed, kept, dots, hidden)


@pytest.mark.slow
@needs_libtpu
def test_tpus_that_run_mosaic_kernels_attend_through_the_splash_kernel():
    """A v5e's runtime chooses Pallas's splash kernel, a v2's and a v3's XLA's ops (and the report says why); GPT's
    training step for a v5e calls the kernel (a Mosaic custom call) on each device's rows."""
    from jaxport import runtime
    from jaxport.gpt.trainer import compile_target, training_mesh

    chosen = {
        name: runtime.for_devices(compile_for.topology_devices(topologies.parse_slice(name))).attention
        for name in ("v2-8", "v3-8", "v5e-4")
    }
    assert chosen == {"v2-8": "xla", "v3-8": "xla", "v5e-4": "splash"}
    run = dict(n_layer=1, n_head=2, n_embd=128, block_size=128, batch_size=1, gradient_accumulation_steps=4)
    run.update(dataset="none", dropout=0.0, dtype="bfloat16")
    mesh = training_mesh(run, compile_for.topology_devices(topologies.parse_slice("v5e-4")))
    step, args = compile_target(run, mesh)
    assert "tpu_custom_call" in step.lower(*args).as_text()
    assert "a v2 runs no Pallas Mosaic kernels" in compile_for.attention_line("xla", "v2")


# -- each family's command


@pytest.mark.slow
@needs_libtpu
def test_gpt_train_compiles_for_a_tpu_slice(tmp_path):
    n_layer, n_head, n_embd, block, batch, vocab = 2, 4, 256, 128, 4, 50304
    proc = jaxport(
        "gpt", "train", "--compile-for", "v4-8", f"--n_layer={n_layer}", f"--n_head={n_head}", f"--n_embd={n_embd}",
        f"--block_size={block}", f"--batch_size={batch}", "--gradient_accumulation_steps=4", "--dataset=none",
        cwd=tmp_path,
    )  # fmt: skip
    # nanoGPT's estimate_mfu count: 6 per parameter (wpe aside) and token, attention 12 L H Q T per token
    params = vocab * n_embd + n_layer * (12 * n_embd**2 + 13 * n_embd) + 2 * n_embd
    per_token = 6 * params + 12 * n_layer * n_head * (n_embd // n_head) * block
    report = check(proc, per_token * batch * block)
    assert "mesh data=4 fsdp=1 model=1 (--fsdp=1)" in report["text"]
    assert not list(tmp_path.iterdir()), "nothing written"


def collective_bytes(text: str) -> dict[str, float]:
    """Bytes per device of each kind of collective in a report's collectives line."""
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("collectives")]
    found = re.findall(r"([\w-]+) x\d+: ([\d.]+) (B|KiB|MiB|GiB) \(", line)
    return {kind: float(n) * BYTES[unit] for kind, n, unit in found}


@pytest.mark.slow
@needs_libtpu
def test_gpt_fsdp_moves_the_weights_not_the_batch(tmp_path):
    """FSDP gathers each weight (in the compute dtype, for the forward and again for the backward) and
    reduce-scatters its float32 gradient: at most 8 bytes per parameter cross the links, whatever the batch. A step
    that splits the products' contraction over the fsdp axis instead all-reduces activations and logits of the
    whole global batch, many times the parameters' bytes."""
    n_layer, n_embd, block, vocab = 2, 256, 128, 50304
    proc = jaxport(
        "gpt", "train", "--compile-for", "v4-8", "--fsdp=4", f"--n_layer={n_layer}", "--n_head=4",
        f"--n_embd={n_embd}", f"--block_size={block}", "--batch_size=16", "--gradient_accumulation_steps=4",
        "--dataset=none", cwd=tmp_path,
    )  # fmt: skip
    report = check(proc, None)
    assert "mesh data=1 fsdp=4 model=1 (--fsdp=4)" in report["text"]
    params = (vocab + block) * n_embd + n_layer * (12 * n_embd**2 + 2 * n_embd) + n_embd  # bias=False
    moved = collective_bytes(report["text"])
    assert moved.get("all-gather", 0) > 0, report["text"]  # the weights are gathered
    assert sum(moved.values()) <= 8 * params, (moved, 8 * params, report["text"])


@pytest.mark.slow
@needs_libtpu
def test_a_program_too_large_names_the_mesh_that_fits(tmp_path):
    """2.3 GB of float32 weights, with their AdamW moments and gradients, do not fit a v2 core's 8 GiB; FSDP over the 8
    cores does. The command prints its report, then exits with DOES_NOT_FIT (a job script's pre-flight check)."""
    proc = jaxport(
        "gpt", "train", "--compile-for", "v2-8", "--n_layer=1", "--n_head=40", "--n_embd=5120", "--block_size=64",
        "--batch_size=1", "--gradient_accumulation_steps=8", "--dataset=none", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == compile_for.DOES_NOT_FIT, proc.stderr[-3000:]
    (report,) = reports(proc.stdout)
    assert not report["fits"] and report["needed"] > report["hbm"], report["text"]
    assert re.search(r"its arguments take [\d.]+ GiB per device\n", report["text"] + "\n"), report["text"]
    assert re.search(r"DOES NOT FIT with --fsdp=1; use --fsdp=(2|4|8) \([\d.]+ GiB per device\)", report["text"])


def trm_dataset(tmp_path: Path, seq_len: int, vocab: int) -> Path:
    """A TRM dataset folder holding only its training split's dataset.json."""
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    meta = dict(pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=vocab, seq_len=seq_len)
    meta.update(num_puzzle_identifiers=1, total_groups=10, mean_puzzle_examples=1.0, total_puzzles=10, sets=["all"])
    (data / "dataset.json").write_text(json.dumps(meta))
    return data.parent


@pytest.mark.slow
@needs_libtpu
def test_trm_train_compiles_from_the_dataset_metadata_alone(tmp_path):
    seq_len, vocab = 64, 11
    data = trm_dataset(tmp_path, seq_len, vocab)
    D, heads, L_layers, H, L, batch = 128, 4, 2, 2, 2, 32
    proc = jaxport(
        "trm", "train", "arch=trm", f"data_paths=[{data}]", "evaluators=[]", f"global_batch_size={batch}",
        f"arch.hidden_size={D}", f"arch.num_heads={heads}", f"arch.L_layers={L_layers}", f"arch.H_cycles={H}",
        f"arch.L_cycles={L}", "arch.puzzle_emb_ndim=0", "arch.puzzle_emb_len=0", "arch.halt_max_steps=2",
        f"checkpoint_path={tmp_path / 'run'}", "--compile-for", "v4-8", cwd=tmp_path,
    )  # fmt: skip
    # per token and block application: q, k, v, o (8 D^2), scores and values (4 S D), the SwiGLU (6 D I); H (L + 1)
    # applications of L_layers blocks forward, the last cycle's L + 1 also backward (twice the forward); the head
    mlp = swiglu_intermediate_size(D, 4.0)
    per_block = 8 * D * D + 4 * seq_len * D + 6 * D * mlp
    applications = (H * (L + 1) + 2 * (L + 1)) * L_layers
    report = check(proc, (per_block * applications + 3 * 2 * D * vocab) * (batch // 4) * seq_len)
    assert "global_batch_size 32, 8 per device" in report["text"]
    assert not (tmp_path / "run").exists(), "no run folder"


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("mixer", ["mlp_t", "attention"])
def test_trm_step_keeps_each_devices_rows_on_a_slice(tmp_path, mixer):
    """Data parallel on a v4-8: the step's only all-gather is the sign-SGD update's, of the batch's puzzle-embedding
    row gradients `[B, E]` (upstream gathers them too); activations, whose gathers grow with every block's `S*B*D`,
    stay split, and no collective reshards them."""
    from jaxport.distributed import make_mesh
    from jaxport.trm.run_config import load_run_config
    from jaxport.trm.train import compile_target

    data = trm_dataset(tmp_path, seq_len=16, vocab=11)
    D, batch = 64, 32
    mixer_args = ["arch.mlp_t=True", "arch.pos_encodings=none"] if mixer == "mlp_t" else []
    config = load_run_config(
        ["arch=trm", f"data_paths=[{data}]", "evaluators=[]", f"global_batch_size={batch}", f"arch.hidden_size={D}",
         "arch.num_heads=2", "arch.L_layers=1", "arch.H_cycles=2", "arch.L_cycles=2", "arch.halt_max_steps=2",
         *mixer_args]
    )  # fmt: skip
    tpu = topologies.parse_slice("v4-8")
    mesh = make_mesh(data=-1, devices=compile_for.topology_devices(tpu))
    step, args = compile_target(config, mesh)
    report = compile_for.analyse(tpu, compile_for.Program("TRM step", step, args, mesh, ""))
    kinds = {c.kind: c for c in report.collectives}
    assert set(kinds) <= {"all-reduce", "all-gather"}, report.collectives
    puzzle_row_grads = batch * D * 4  # float32, puzzle_emb_ndim = hidden_size
    assert sum(c.bytes for c in report.collectives if c.kind == "all-gather") <= puzzle_row_grads, report.collectives


def dream_folder(tmp_path: Path, **sizes) -> Path:
    """A Dream folder with config.json and the tokenizer files only: no weights."""
    folder = tmp_path / "dream"
    folder.mkdir()
    for f in TINY_DREAM.iterdir():
        if not f.name.startswith("model") and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    config = {**json.loads((TINY_DREAM / "config.json").read_text()), **sizes}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def dream_params(D: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int) -> int:
    """Parameters in matrix products per token: the layers' projections and MLP, and the untied head."""
    kv = kv_heads * D // heads
    return layers * (2 * D * D + 2 * D * kv + 3 * D * inter) + D * vocab


DREAM = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow
@needs_libtpu
def test_dream_train_compiles_from_config_and_tokenizer_alone(tmp_path):
    model = dream_folder(tmp_path, **DREAM)
    seq_len, batch = 64, 8
    proc = jaxport(
        "dream", "train", "--model", str(model), "--data", str(tmp_path / "absent.txt"), "--seq-len", str(seq_len),
        "--batch-size", str(batch), "--out-dir", str(tmp_path / "run"), "--compile-for", "v4-8",
    )  # fmt: skip
    params = dream_params(256, 512, 2, 4, 2, 512)
    per_token = 6 * params + 12 * 2 * seq_len * 256  # weights forward and backward; full attention
    report = check(proc, per_token * (batch // 4) * seq_len)
    assert "float32 weights and AdamW moments" in report["text"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@needs_libtpu
def test_dream_generate_compiles_its_program(tmp_path):
    """One decoding step with every position of the canvas but the prompt masked: the work of upstream's
    full-canvas forward. (`serve --compile-for`'s programs: tests/test_dream_serve.py, against a server's.)"""
    model = dream_folder(tmp_path, **DREAM)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("def add(a, b):") + "\n")
    new = 120
    proc = jaxport(
        "dream", "generate", "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", str(new), "--steps",
        "1", "--batch-size", "4", "--mesh", "4,1,1", "--compile-for", "v4-8",
    )  # fmt: skip
    prompt = int(re.search(r"prompt (\d+) \+", proc.stdout).group(1))
    length = prompt + new
    per_token = 2 * dream_params(256, 512, 2, 4, 2, 512) + 4 * 2 * length * 256
    report = check(proc, per_token * length)  # one row per device
    assert "(--mesh 4,1,1)" in report["text"] and "without the command's progress callback" in report["text"]
