"""Dream forward parity with upstream DreamModel (fixtures/dream) and checkpoint loading errors."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxport import dream
from jaxport.errors import JaxportError

FIXTURES = Path(__file__).parent / "fixtures" / "dream"
SHARDED, BF16 = FIXTURES / "tiny_sharded", FIXTURES / "tiny_bf16"


def tolerance(case: Path, name: str) -> dict:
    tol = json.loads((case / "case.json").read_text())["tolerances"][name]
    return {"atol": tol["atol"], "rtol": tol["rtol"]}


@pytest.fixture(scope="module")
def expected():
    return np.load(SHARDED / "expected.npz")


@pytest.fixture(scope="module")
def model():
    return dream.load(SHARDED / "model", dtype="float32")[0]


def test_config_from_checkpoint(model):
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.mask_token_id == 423 and not cfg.tie_word_embeddings and model.lm_head is not None
    assert model.layers[0].self_attn.q_proj.bias is not None and model.layers[0].self_attn.o_proj.bias is None


@pytest.mark.slow
def test_padded_logits_and_hidden_states(model, expected):
    valid = expected["valid_positions"]
    logits, states = model(expected["sampler_input_ids"], valid.astype(np.int32), output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(logits)[valid], expected["logits"][valid], **tolerance(SHARDED, "logits"))
    assert len(states) == expected["hidden_states"].shape[0]
    for got, want in zip(states, expected["hidden_states"]):
        np.testing.assert_allclose(np.asarray(got)[valid], want[valid], **tolerance(SHARDED, "hidden_states"))
    # pad queries attend to nothing: finite outputs, and nothing leaks into real positions
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.slow
def test_explicit_4d_mask_and_position_ids(model, expected):
    valid = expected["valid_positions"]
    logits = model(
        expected["sampler_input_ids"],
        expected["sampler_attention_mask_4d"],
        position_ids=expected["sampler_position_ids"],
    )
    np.testing.assert_allclose(np.asarray(logits)[valid], expected["logits"][valid], **tolerance(SHARDED, "logits"))
    shifted = np.concatenate([np.asarray(logits)[:, :1], np.asarray(logits)[:, :-1]], axis=1)
    np.testing.assert_allclose(
        shifted[valid], expected["logits_shifted"][valid], **tolerance(SHARDED, "logits_shifted")
    )


@pytest.mark.slow
def test_hidden_states_at_rows_match_the_full_forward(model, expected):
    """Exact decoding runs the last layer's queries and MLP at the positions it scores only: the same states, and
    upstream's logits there, with a padding mask and for rows in any order, repeated, per batch row."""
    import jax.numpy as jnp

    from jaxport.dream.program import padding_inputs
    from jaxport.nn import take_rows

    ids, valid = jnp.asarray(expected["sampler_input_ids"]), expected["valid_positions"]
    B, N = ids.shape
    mask, positions = padding_inputs(jnp.asarray(valid, jnp.int32), B, N)
    full = np.asarray(model.hidden_states(ids, mask, positions))
    rows = np.stack([np.random.default_rng(b).choice(np.flatnonzero(valid[b]), 5) for b in range(B)])
    at_rows = np.asarray(model.hidden_states_at(ids, mask, positions)(jnp.asarray(rows)))
    assert at_rows.shape == (B, 5, model.config.hidden_size)
    np.testing.assert_allclose(at_rows, np.asarray(take_rows(full, rows)), rtol=1e-5, atol=1e-5)
    logits = np.asarray(model.head(jnp.asarray(at_rows)))
    want = np.take_along_axis(expected["logits"], rows[..., None], axis=1)
    np.testing.assert_allclose(logits, want, **tolerance(SHARDED, "logits"))
    # block-wise decoding on a CPU reads the projection's weight laid out as [D, V]: upstream's logits too
    table_DV = model.head_table_DV()
    assert table_DV.shape == (model.config.hidden_size, model.config.vocab_size)
    np.testing.assert_allclose(
        np.asarray(model.head(jnp.asarray(at_rows), table_DV)), want, **tolerance(SHARDED, "logits")
    )


@pytest.mark.slow
def test_unpadded_logits(model, expected):
    longest = expected["sampler_input_ids"][:1]
    np.testing.assert_allclose(
        np.asarray(model(longest)), expected["logits_nopad"], **tolerance(SHARDED, "logits_nopad")
    )
    # an all-ones mask means full attention with positions 0..N-1
    np.testing.assert_allclose(
        np.asarray(model(longest, np.ones_like(longest))),
        expected["logits_nopad"],
        **tolerance(SHARDED, "logits_nopad"),
    )


@pytest.mark.slow
def test_bfloat16_checkpoint():
    expected = np.load(BF16 / "expected.npz")
    valid = expected["valid_positions"]
    ids, mask = expected["sampler_input_ids"], valid.astype(np.int32)
    model_bf16, _ = dream.load(BF16 / "model", dtype="bfloat16")
    logits = model_bf16(ids, mask)
    assert logits.dtype == np.dtype("bfloat16")
    np.testing.assert_allclose(
        np.asarray(logits, np.float32)[valid], expected["logits_bf16"][valid], **tolerance(BF16, "logits_bf16")
    )
    model_f32, _ = dream.load(BF16 / "model", dtype="float32")
    np.testing.assert_allclose(
        np.asarray(model_f32(ids, mask))[valid],
        expected["logits_f32_same_weights"][valid],
        **tolerance(BF16, "logits_f32_same_weights"),
    )


@pytest.mark.slow
def test_single_file_checkpoint(tmp_path, expected):
    """`model.safetensors` without an index (written by safetensors from the shards)."""
    from safetensors.numpy import load_file, save_file

    model_dir = tmp_path / "single"
    shutil.copytree(SHARDED / "model", model_dir)
    tensors = {
        name: t for shard in sorted(model_dir.glob("model-*.safetensors")) for name, t in load_file(shard).items()
    }
    for f in model_dir.glob("model-*.safetensors"):
        f.unlink()
    (model_dir / "model.safetensors.index.json").unlink()
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    single, _ = dream.load(model_dir)
    np.testing.assert_allclose(
        np.asarray(single(expected["sampler_input_ids"][:1])),
        expected["logits_nopad"],
        **tolerance(SHARDED, "logits_nopad"),
    )


def copy_model(tmp_path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(SHARDED / "model", target)
    return target


def edit_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def test_missing_shard(tmp_path):
    model_dir = copy_model(tmp_path)
    (model_dir / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(JaxportError, match=r"missing shard .*model-00003-of-00004\.safetensors"):
        dream.load(model_dir)


def test_wrong_dtype_request():
    with pytest.raises(JaxportError, match=r"unsupported dtype 'float16'.*'float32' or 'bfloat16'"):
        dream.load(SHARDED / "model", dtype="float16")


def test_not_a_dream_directory(tmp_path):
    with pytest.raises(JaxportError, match=r"is not a Dream model directory: no config.json"):
        dream.load(tmp_path)
    model_dir = copy_model(tmp_path)
    edit_config(model_dir, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(JaxportError, match=r"model_type 'llama', not a Dream model"):
        dream.load(model_dir)


def test_shape_that_does_not_fit_config(tmp_path):
    model_dir = copy_model(tmp_path)
    edit_config(model_dir, intermediate_size=96)
    with pytest.raises(
        JaxportError,
        match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight has shape \[64, 128\] "
        r"but config\.json implies \[64, 96\]",
    ):
        dream.load(model_dir)


def test_missing_tensor(tmp_path):
    model_dir = copy_model(tmp_path)
    edit_config(model_dir, num_hidden_layers=3)
    with pytest.raises(JaxportError, match=r"checkpoint has no tensor model\.layers\.2\."):
        dream.load(model_dir)


@pytest.mark.slow
def test_random_init_preset():
    model = dream.random_model(dream.preset("tiny"), dtype="bfloat16")
    logits = model(np.arange(10, dtype=np.int32)[None])
    assert logits.shape == (1, 10, 512) and logits.dtype == np.dtype("bfloat16")
    with pytest.raises(JaxportError, match=r"unknown Dream size 'huge'"):
        dream.preset("huge")


@pytest.mark.slow
def test_tied_word_embeddings(tmp_path, expected):
    """tie_word_embeddings: no lm_head tensor is read; logits are the final state times the embedding."""
    model_dir = copy_model(tmp_path)
    edit_config(model_dir, tie_word_embeddings=True)
    tied, _ = dream.load(model_dir)
    assert tied.lm_head is None
    ids = expected["sampler_input_ids"][:1]
    logits, states = tied(ids, output_hidden_states=True)
    table = np.asarray(tied.embed_tokens.embedding_weight[...])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(states[-1]) @ table.T, atol=1e-4, rtol=1e-4)
    from_DV = tied.head(states[-1], tied.head_table_DV())  # the [D, V] copy of block-wise decoding: the embedding's
    np.testing.assert_allclose(np.asarray(from_DV), np.asarray(logits), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(states[-1])[0], expected["hidden_states"][-1][0], atol=2e-4, rtol=1e-4)
