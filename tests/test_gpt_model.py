"""jaxport.gpt.GPT against nanoGPT's recorded outputs (fixtures/gpt/nanogpt_ckpt*, hf_gpt2_tiny)."""

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxport import gpt
from jaxport.errors import JaxportError
from jaxport.gpt.params import model_state_dict

FIXTURES = Path(__file__).parent / "fixtures" / "gpt"
CKPT_CASES = ["nanogpt_ckpt", "nanogpt_ckpt_nobias", "nanogpt_ckpt_orig_mod"]


def load_case(name):
    d = FIXTURES / name
    case = json.loads((d / "case.json").read_text())
    inputs = dict(np.load(d / "inputs.npz")) if (d / "inputs.npz").exists() else {}
    return SimpleNamespace(dir=d, case=case, inputs=inputs, expected=dict(np.load(d / "expected.npz")))


def close(actual, expected, tol):
    np.testing.assert_allclose(np.asarray(actual), expected, atol=tol["atol"], rtol=tol["rtol"])


@pytest.fixture(scope="module", params=CKPT_CASES)
def ckpt_case(request):
    c = load_case(request.param)
    return c, gpt.GPT.from_checkpoint(c.dir / "ckpt.pt")


@pytest.mark.slow
def test_forward_logits_and_losses(ckpt_case):
    c, model = ckpt_case
    tol, x, e = c.case["tolerances"], c.inputs, c.expected
    assert model.config.to_model_args() == c.case["model_args"]
    logits, loss = model(x["idx"], x["targets"])
    close(logits, e["logits"], tol["logits"])
    close(loss, e["loss"], tol["loss"])
    close(model(x["idx"], x["targets_ignore"])[1], e["loss_ignore"], tol["loss_ignore"])
    logits_short, loss_short = model(x["idx_short"], x["targets_short"])
    close(logits_short, e["logits_short"], tol["logits_short"])
    close(loss_short, e["loss_short"], tol["loss_short"])
    last, none = model(x["idx"])
    assert none is None and last.shape == e["logits_last"].shape
    close(last, e["logits_last"], tol["logits_last"])


def last_logits(model, seqs, lengths):
    """Logits after each of `lengths` ids of `seqs`, as nanoGPT sees them (context cropped to
    its last block_size ids). Causality lets one full-width forward serve every uncropped length."""
    T = model.config.block_size
    full = model(seqs[:, :T], seqs[:, :T])[0]
    return np.stack(
        [np.asarray(full[:, n - 1]) if n <= T else np.asarray(model(seqs[:, n - T : n])[0][:, 0]) for n in lengths]
    )


@pytest.mark.slow
def test_greedy_generation_crosses_block_size(ckpt_case):
    c, model = ckpt_case
    x, e, tol = c.inputs, c.expected, c.case["tolerances"]
    P, n = x["prompt"].shape[1], e["gen_greedy"].shape[1] - x["prompt"].shape[1]
    assert P + n > model.config.block_size
    tokens, step_logits = model.generate(x["prompt"], n, temperature=1.0, top_k=1, return_logits=True)
    np.testing.assert_array_equal(np.asarray(tokens), e["gen_greedy"])
    close(step_logits, e["gen_greedy_step_logits"], tol["gen_greedy_step_logits"])
    # the recorded context lengths are nanoGPT's cropping: min(P + i, block_size) trailing ids
    np.testing.assert_array_equal(e["gen_greedy_context_len"], np.minimum(P + np.arange(n), model.config.block_size))


@pytest.mark.slow
def test_sampling_distribution(ckpt_case):
    c, model = ckpt_case
    x, e, tol = c.inputs, c.expected, c.case["tolerances"]
    P, n = x["prompt"].shape[1], e["sample_probs"].shape[0]
    logits = last_logits(model, e["sample_tokens"], [P + i for i in range(n)])
    for i in range(n):
        close(gpt.sample_probs(logits[i], 0.8, 5), e["sample_probs"][i], tol["sample_probs"])


@pytest.mark.slow
def test_kv_cache_sampling_equals_full_recomputation(ckpt_case):
    _, model = ckpt_case
    prompt = np.asarray(ckpt_case[0].inputs["prompt"])
    n, T = 24, model.config.block_size
    rng = jax.random.key(7)
    tokens = np.asarray(model.generate(prompt, n, temperature=0.9, top_k=8, rng=rng))
    seq = prompt.astype(np.int32)
    for _ in range(n):  # nanoGPT's loop: a full forward of the cropped context every step
        rng, key = jax.random.split(rng)
        width = min(seq.shape[1], T)  # pad to block_size: one compiled shape, causality keeps it exact
        window = np.pad(seq[:, -width:], ((0, 0), (0, T - width)))
        probs = gpt.sample_probs(model(window, window)[0][:, width - 1], 0.9, 8)
        nxt = jax.random.categorical(key, jnp.log(probs), axis=-1)
        seq = np.concatenate([seq, np.asarray(nxt, np.int32)[:, None]], axis=1)
    np.testing.assert_array_equal(tokens, seq)


@pytest.mark.slow
def test_generate_within_block_size_uses_only_the_cache():
    c = load_case("nanogpt_ckpt")
    model = gpt.GPT.from_checkpoint(c.dir / "ckpt.pt")
    prompt = c.inputs["prompt"][:, :1]  # one token, as sample.py's default start "\n"
    tokens, step_logits = model.generate(prompt, 5, top_k=1, return_logits=True)
    full = model(tokens[:, :-1], tokens[:, 1:])[0]  # causal: position i sees tokens[:, :i + 1]
    close(step_logits, np.asarray(full).transpose(1, 0, 2), c.case["tolerances"]["gen_greedy_step_logits"])
    np.testing.assert_array_equal(np.asarray(tokens)[:, 1:], np.argmax(full, -1))


@pytest.mark.slow
def test_generate_from_prompt_longer_than_block_size():
    c = load_case("nanogpt_ckpt")
    model = gpt.GPT.from_checkpoint(c.dir / "ckpt.pt")
    P, T = 40, model.config.block_size
    prompt = np.concatenate([c.inputs["idx"][:2], c.inputs["idx_short"][:2, : P - T]], axis=1)
    tokens = np.asarray(model.generate(prompt, 3, top_k=1))
    np.testing.assert_array_equal(tokens[:, :P], prompt)
    for i in range(3):  # each step sees only the last block_size ids
        logits = model(tokens[:, P + i - T : P + i])[0][:, 0]
        np.testing.assert_array_equal(np.argmax(logits, -1), tokens[:, P + i])


def test_num_params_and_mfu(ckpt_case):
    c, model = ckpt_case
    e, x = c.expected, c.inputs
    assert model.get_num_params() == int(e["num_params_non_embedding"])
    assert model.get_num_params(non_embedding=False) == int(e["num_params_total"])
    mfu = [model.estimate_mfu(int(f), float(dt)) for f, dt in zip(x["mfu_fwdbwd_per_iter"], x["mfu_dt"])]
    np.testing.assert_allclose(mfu, e["mfu"], rtol=c.case["tolerances"]["mfu"]["rtol"], atol=0)
    # against another peak the ratio scales inversely
    assert model.estimate_mfu(1, 1.0, peak_flops=989e12) == pytest.approx(
        mfu[0] / x["mfu_fwdbwd_per_iter"][0] * x["mfu_dt"][0] * 312 / 989
    )


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("cpu", None),
    ],
)
def test_device_peak_flops(kind, peak):
    assert gpt.device_peak_flops(SimpleNamespace(device_kind=kind)) == (peak, kind)


@pytest.mark.slow
def test_crop_block_size():
    c = load_case("nanogpt_ckpt")
    model = gpt.GPT.from_checkpoint(c.dir)  # a folder holding ckpt.pt works too
    model.crop_block_size(16)
    assert model.config.block_size == 16 and model.wpe.shape == (16, 32)
    close(
        model(c.inputs["idx_short"], c.inputs["targets_short"])[0],
        c.expected["logits_short"],
        c.case["tolerances"]["logits_short"],
    )
    with pytest.raises(JaxportError, match="cannot forward a sequence of length 32: block_size is only 16"):
        model(c.inputs["idx"])
    with pytest.raises(JaxportError, match="block_size 64 is larger than the model's block_size 16"):
        model.crop_block_size(64)


@pytest.mark.slow
def test_dropout_only_with_rng():
    model = gpt.GPT.init(gpt.GPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=16, dropout=0.5))
    idx = np.arange(24).reshape(2, 12) % 40
    a, b = model(idx, idx)[0], model(idx, idx)[0]
    np.testing.assert_array_equal(a, b)
    c = model(idx, idx, rng=jax.random.key(1))[0]
    assert not np.allclose(a, c)
    # nanoGPT's init: N(0, 0.02) weights, residual projections N(0, 0.02/sqrt(2*n_layer)), zero biases
    sd = model_state_dict(model)
    assert abs(sd["transformer.h.0.mlp.c_fc.weight"].std() - 0.02) < 0.003
    assert abs(sd["transformer.h.0.mlp.c_proj.weight"].std() - 0.01) < 0.0015
    assert not sd["transformer.h.0.mlp.c_fc.bias"].any()


# -- Hugging Face GPT-2 ------------------------------------------------------------------------


def _hf_reference_forward(weights, cfg, idx):
    """GPT-2 as HF computes it, in numpy: Conv1D x @ W + b, gelu_new (tanh) activation."""
    w = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in weights.items()}

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + cfg["layer_norm_epsilon"]) * w[
            p + ".weight"
        ] + w[p + ".bias"]

    B, T = idx.shape
    H, C = cfg["n_head"], cfg["n_embd"]
    x = w["wte.weight"][idx] + w["wpe.weight"][np.arange(T)]
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        q, k, v = np.split(ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"], 3, -1)
        q, k, v = (a.reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for a in (q, k, v))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(C // H) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        y = (a / a.sum(-1, keepdims=True)) @ v
        x = x + y.transpose(0, 2, 1, 3).reshape(B, T, C) @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ w["wte.weight"].T


@pytest.fixture(scope="module")
def hf_case():
    return load_case("hf_gpt2_tiny")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hf", "hf_hub_layout"])
def test_from_pretrained_matches_nanogpt(hf_case, layout):
    c, x, e, tol = hf_case, hf_case.inputs, hf_case.expected, hf_case.case["tolerances"]
    model = gpt.GPT.from_pretrained(c.dir / layout)
    assert model.config.to_model_args() == c.case["nanogpt_config_after_from_pretrained"]
    sd, ref = model_state_dict(model), np.load(c.dir / "nanogpt_state_dict.npz")
    assert set(sd) == set(ref.files)
    for k in ref.files:
        np.testing.assert_array_equal(sd[k], ref[k], err_msg=k)
    logits, loss = model(x["idx"], x["targets"])
    close(logits, e["nanogpt_logits"], tol["nanogpt_logits"])
    close(loss, e["nanogpt_loss"], tol["nanogpt_loss"])
    # nanoGPT's exact-erf GELU is not HF's gelu_new: the logits differ by far more than the tolerance
    assert np.abs(np.asarray(logits) - e["hf_logits"]).max() > 10 * tol["hf_logits"]["atol"]
    close(model(x["idx"])[0], e["nanogpt_logits_last"], tol["nanogpt_logits_last"])
    close(
        model(x["idx_full_context"], x["idx_full_context"])[0],
        e["nanogpt_logits_full_context"],
        tol["nanogpt_logits_full_context"],
    )
    n = e["nanogpt_gen_greedy"].shape[1] - x["prompt"].shape[1]
    tokens, step_logits = model.generate(x["prompt"], n, top_k=1, return_logits=True)
    np.testing.assert_array_equal(np.asarray(tokens), e["nanogpt_gen_greedy"])
    close(step_logits, e["nanogpt_gen_greedy_step_logits"], tol["nanogpt_gen_greedy_step_logits"])


def test_hf_reference_logits_and_loss(hf_case):
    """The HF weights themselves (Conv1D layout, tanh GELU) give the recorded HF numbers."""
    from safetensors.numpy import load_file

    c, x, e, tol = hf_case, hf_case.inputs, hf_case.expected, hf_case.case["tolerances"]
    weights = load_file(c.dir / "hf" / "model.safetensors")
    cfg = json.loads((c.dir / "hf" / "config.json").read_text())
    logits = _hf_reference_forward(weights, cfg, x["idx"])
    close(logits, e["hf_logits"], tol["hf_logits"])
    close(
        _hf_reference_forward(weights, cfg, x["idx_full_context"]),
        e["hf_logits_full_context"],
        tol["hf_logits_full_context"],
    )
    logp = logits[:, :-1] - np.log(np.exp(logits[:, :-1]).sum(-1, keepdims=True))
    loss = -np.take_along_axis(logp, x["idx"][:, 1:, None], -1).mean()
    close(loss, e["hf_loss_shifted_labels"], tol["hf_loss_shifted_labels"])


def test_from_pretrained_by_name(hf_case, tmp_path, monkeypatch):
    (tmp_path / "gpt2").symlink_to(hf_case.dir / "hf")
    monkeypatch.setenv("JAXPORT_GPT2_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    model = gpt.GPT.from_pretrained("gpt2", override_args=dict(dropout=0.1))
    assert model.config.n_layer == 2 and model.config.dropout == 0.1
    with pytest.raises(JaxportError, match=r"GPT-2 weights 'gpt2-xl' not found .*JAXPORT_GPT2_DIR"):
        gpt.GPT.from_pretrained("gpt2-xl")
    with pytest.raises(JaxportError, match="only dropout can be overridden"):
        gpt.GPT.from_pretrained("gpt2", override_args=dict(n_layer=3))
