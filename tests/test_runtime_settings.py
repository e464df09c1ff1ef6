"""The runtime settings a user can set (`--runtime NAME=VALUE,...`, a family's config): parsed with one error naming
the bad key or value, applied to the programs jitted afterwards, printed at start-up and recorded with the run."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxport import runtime
from jaxport.errors import JaxportError
from jaxport.nn import dot_product_attention
from jaxport.runtime import settings
from jaxport.runtime.settings import RuntimeSettings


def test_settings_parse_from_the_command_line_later_ones_winning():
    chosen, rest = runtime.take_settings(
        ["train", "--runtime", "attention=xla,remat=none", "--n_layer=2", "--runtime=remat=attention_scores"]
    )
    assert rest == ["train", "--n_layer=2"]
    assert chosen.explicit() == {"attention": "xla", "remat": "attention_scores"}
    assert RuntimeSettings.parse("").explicit() == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("attention=flash", "runtime: attention=flash is not one of auto, xla, causal_blocks, cudnn, splash"),
        ("remat=full", "runtime: remat=full is not one of auto, none, attention_scores, block, save_dots"),
        ("atention=xla", "runtime: unknown setting 'atention'; the settings are attention, remat, row_major_operands"),
        ("attention", "runtime: 'attention': expected NAME=VALUE pairs separated by commas"),
    ],
)
def test_a_bad_setting_is_one_error_naming_it_and_the_allowed_ones(text, message):
    with pytest.raises(JaxportError, match="^" + message.replace("(", r"\(")):
        RuntimeSettings.parse(text)


def test_trm_s_config_takes_the_settings_as_hydra_overrides():
    from jaxport.trm.run_config import load_run_config

    config = load_run_config(["data_paths=[x]", "runtime.attention=xla", "runtime.remat=none"])
    assert config.runtime.explicit() == {"attention": "xla", "remat": "none"}
    with pytest.raises(JaxportError, match="runtime: split_rows=maybe is not one of auto, on, off"):
        load_run_config(["data_paths=[x]", "runtime.split_rows=maybe"])


def test_the_command_line_wins_over_the_config_and_host_settings_belong_to_the_command_line():
    settings.start(RuntimeSettings.parse("attention=xla,host_memory=off"), trains=False)
    runtime.configure(RuntimeSettings.parse("attention=causal_blocks,remat=attention_scores,split_rows=off"))
    assert settings.chosen().explicit() == {
        "attention": "xla",
        "remat": "attention_scores",
        "split_rows": "off",
        "host_memory": "off",
    }
    with pytest.raises(JaxportError, match="async_dispatch=off applies to the process .* --runtime async_dispatch"):
        runtime.configure(RuntimeSettings.parse("async_dispatch=off"))


def attention_program(program_runtime):
    """(the runtime a jitted causal attention saw while traced, its lowered text)."""
    seen = []

    def attention(q):
        seen.append(runtime.current())
        return dot_product_attention(q, q, q, causal=True)

    q = jax.ShapeDtypeStruct((1, 256, 2, 16), jnp.float32)
    text = runtime.jit(attention, program_runtime).lower(q).as_text()
    return seen[0], text


def test_an_override_changes_the_program_the_layers_build():
    automatic, blocks_text = attention_program(runtime.for_devices(jax.devices("cpu")))
    runtime.configure(RuntimeSettings.parse("attention=xla,row_major_operands=off"))
    chosen, xla_text = attention_program(runtime.for_devices(jax.devices("cpu")))
    assert (automatic.attention, automatic.row_major_operands) == ("causal_blocks", True)
    assert (chosen.attention, chosen.row_major_operands, chosen.split_rows) == ("xla", False, True)
    assert xla_text.count("dot_general") < blocks_text.count("dot_general")  # one product, not one per block


def test_remat_of_attention_scores_recomputes_them_in_the_backward_pass():
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 128, 2, 16)), jnp.float32)
    loss = lambda q: jnp.sum(dot_product_attention(q, q, q, causal=True) ** 2)  # noqa: E731

    def primitives():
        with runtime.use(runtime.for_devices(jax.devices("cpu"))):
            return {equation.primitive.name for equation in jax.make_jaxpr(jax.grad(loss))(q).jaxpr.eqns}

    assert "remat2" not in primitives()  # the CPU's default: none
    for attention in ("xla", "causal_blocks"):
        runtime.configure(RuntimeSettings.parse(f"attention={attention},remat=attention_scores"))
        assert "remat2" in primitives()  # jax.checkpoint's


# The backend's optimisation level changes how fast a program runs, not what it computes (XLA's HLO passes, remat's
# barriers among them, run as ever); at 0 these tiny programs compile in half the CPU time.
QUICK_COMPILE = {"xla_backend_optimization_level": 0}


def with_random_params(build):
    """The module `build()` makes, built as shapes alone (an initialiser costs a compile), its parameters normal."""
    from flax import nnx

    graphdef, params, rest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(0.0, 0.5, p.shape), p.dtype), params)
    return nnx.merge(graphdef, params, rest)


def tiny_gpt():
    from flax import nnx

    from jaxport.gpt.config import GPTConfig
    from jaxport.gpt.model import GPT

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 9)), jnp.int32)
    config = GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    model = with_random_params(lambda: GPT(config, rngs=nnx.Rngs(0)))
    return model, lambda model: model.forward(tokens[:, :-1], tokens[:, 1:])[1]


def tiny_trm():
    from flax import nnx

    from jaxport import trm
    from jaxport.nn import rotary_cos_sin
    from jaxport.trm.model import ReasoningModule

    config = trm.TRMConfig(
        hidden_size=16, num_heads=2, L_layers=1, vocab_size=11, num_puzzle_identifiers=1, forward_dtype="float32"
    )
    h, weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, 1, 8, 16)), jnp.float32)
    cos_sin = rotary_cos_sin(config.hidden_size // config.num_heads, jnp.arange(8), config.rope_theta)
    module = with_random_params(lambda: ReasoningModule(config, nnx.Rngs(0)))  # TRM's L_level
    return module, lambda module: jnp.sum(module(h, 0.5 * h, cos_sin) * weights)


def tiny_dream():
    from flax import nnx

    from jaxport import dream

    config = dream.DreamConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, mask_token_id=63, pad_token_id=62, eos_token_id=62, bos_token_id=62,
    )  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 8)), jnp.int32)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(1, 8, 16)), jnp.float32)
    model = with_random_params(lambda: dream.DreamModel(config, rngs=nnx.Rngs(0)))
    return model, lambda model: jnp.sum(model.hidden_states(tokens) * weights)


@functools.cache
def tiny(family: str):
    """A tiny model of `family` (one block, one row) and its loss: `gradients(remat)` gives the loss, its gradients
    with respect to the model's parameters on this CPU with `remat`, and whether the compiled program holds
    jax.checkpoint's primitive. The losses weigh the final states at random (a sum of squares after an RMSNorm hardly
    depends on its input: its gradients would be rounding noise)."""
    from flax import nnx

    module, loss = {"gpt": tiny_gpt, "trm": tiny_trm, "dream": tiny_dream}[family]()
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    gradient = jax.value_and_grad(lambda params: loss(nnx.merge(graphdef, params, rest)))

    @functools.cache
    def gradients(remat: str):
        with runtime.use(dataclasses.replace(runtime.for_devices(jax.devices("cpu")), remat=remat)):
            traced = jax.jit(gradient, compiler_options=QUICK_COMPILE).trace(params)
        checkpointed = "remat2" in {equation.primitive.name for equation in traced.jaxpr.eqns}
        return traced.lower().compile()(params), checkpointed

    return gradients


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, remat",
    [("gpt", "attention_scores"), ("gpt", "block"), ("gpt", "save_dots"), ("trm", "block"), ("dream", "save_dots")],
)
def test_each_remat_gives_the_loss_and_gradients_of_none(family, remat):
    """A remat value changes what the backward pass keeps, not what it computes: a tiny model's loss and gradients
    equal those with none (float32, each family's compiled once); block and save_dots checkpoint each block
    (`runtime.remat_block`), which none leaves as it is."""
    (kept_loss, kept_grads), kept_checkpointed = tiny(family)("none")
    (value, grads), checkpointed = tiny(family)(remat)
    assert (kept_checkpointed, checkpointed) == (False, True)
    np.testing.assert_allclose(np.asarray(value), np.asarray(kept_loss), rtol=1e-6)
    for g, kept in zip(jax.tree.leaves(grads), jax.tree.leaves(kept_grads), strict=True):
        scale = float(np.max(np.abs(kept)))  # float32 rounding: relative to each gradient's largest entry
        np.testing.assert_allclose(np.asarray(g), np.asarray(kept), rtol=1e-5, atol=1e-6 * max(scale, 1.0))


def test_the_start_up_line_prints_the_values_in_effect_once(capsys):
    from jaxport.runtime import host_memory

    settings.start(RuntimeSettings.parse("attention=xla,host_memory=off"), trains=False)  # the process unchanged
    runtime.for_devices(jax.devices("cpu"))
    runtime.for_devices(jax.devices("cpu"))
    # the heap's policy is the process's: a test run earlier in this worker may have tuned it, which "off" leaves be
    memory = "training" if host_memory.tuned_for_training() else "serving" if host_memory.tuned() else "off"
    assert capsys.readouterr().err.splitlines() == [
        "runtime: attention=xla remat=none row_major_operands=on head_in_out=on split_rows=on "
        f"host_memory={memory} async_dispatch=" + ("on" if jax.config.read("jax_cpu_enable_async_dispatch") else "off")
    ]


def test_a_run_records_the_settings_in_effect_in_its_saved_config(tmp_path):
    from jaxport.training.run import Run

    runtime.configure(RuntimeSettings.parse("remat=attention_scores,head_in_out=off"))
    with Run(tmp_path, config={"lr": 0.1}, config_name="all_config.yaml", total_steps=1, progress=False) as run:
        run.start_logging()
    saved = yaml.safe_load((tmp_path / "all_config.yaml").read_text())
    assert saved["lr"] == 0.1
    assert {key: saved["runtime"][key] for key in ("attention", "remat", "head_in_out")} == {
        "attention": "causal_blocks",
        "remat": "attention_scores",
        "head_in_out": "off",
    }
    assert set(saved["runtime"]) == set(settings.CHOICES)


@pytest.mark.parametrize("family", ["trm", "gpt", "dream"])
def test_every_family_s_command_takes_runtime_and_names_a_bad_value(family, capsys):
    from jaxport import cli

    assert cli.main([family, "train", "--runtime", "attention=flash"]) == 1  # refused before any host setting
    error = "runtime: attention=flash is not one of auto, xla, causal_blocks, cudnn, splash"
    assert capsys.readouterr().err.strip() == f"jaxport {family}: error: {error}"


def test_a_gpt_config_file_sets_runtime_settings_under_the_command_line_s(tmp_path, keep_malloc_defaults):
    from jaxport import cli

    config = tmp_path / "config.py"
    config.write_text('runtime = "attention=causal_blocks,remat=attention_scores"\n')
    # a bad flag value stops the run once the settings are read, before any work
    argv = ["gpt", "train", str(config), "--runtime=attention=xla", "--batch_size=0"]
    assert cli.main(argv) == 1
    assert {k: settings.chosen().explicit()[k] for k in ("attention", "remat")} == {
        "attention": "xla",
        "remat": "attention_scores",
    }
