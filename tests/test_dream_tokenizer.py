"""Tokenizer, chat template and decoding: the tiny fixture's recorded prompt ids and the real Qwen2 vocabulary."""

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxport.dream import DreamConfig, DreamTokenizer
from jaxport.errors import JaxportError

FIXTURES = Path(__file__).parent / "fixtures" / "dream"
TINY = FIXTURES / "tiny_sharded"
QWEN2 = FIXTURES / "qwen2_tokenizer"
CHAT = [{"role": "user", "content": "Add two numbers."}]


def tiny_tokenizer(model_dir: Path) -> DreamTokenizer:
    return DreamTokenizer.from_model_dir(model_dir, DreamConfig.from_model_dir(model_dir))


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory) -> Path:
    """The official Dream tokenizer files as shipped: vocab.json + merges.txt, no tokenizer.json."""
    target = tmp_path_factory.mktemp("dream_real")
    for name in ("merges.txt", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json", "config.json"):
        shutil.copy(QWEN2 / name, target / name)
    (target / "vocab.json").write_bytes(gzip.decompress((QWEN2 / "vocab.json.gz").read_bytes()))
    return target


@pytest.mark.parametrize("with_tokenizer_json", [True, False])
def test_tiny_prompts_match_recorded_ids(tmp_path, with_tokenizer_json):
    model_dir = TINY / "model"
    if not with_tokenizer_json:
        model_dir = tmp_path / "model"
        shutil.copytree(TINY / "model", model_dir)
        (model_dir / "tokenizer.json").unlink()
    tok = tiny_tokenizer(model_dir)
    inputs = np.load(TINY / "inputs.npz")
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat == str(inputs["prompt_texts"][0])
    input_ids, attention_mask = tok([chat, str(inputs["prompt_texts"][1])])
    np.testing.assert_array_equal(input_ids, inputs["input_ids"])
    np.testing.assert_array_equal(attention_mask, inputs["attention_mask"])


def test_real_qwen2_tokenizer_and_chat_template(real_dir):
    tok = DreamTokenizer.from_model_dir(real_dir, DreamConfig.from_model_dir(real_dir))
    cases = json.loads((QWEN2 / "expected_ids.json").read_text())["cases"]
    for name, case in cases.items():
        assert tok.encode(case["text"]) == case["ids"], name
    messages = [{"role": "user", "content": "Write a Python function that returns the sum of two numbers."}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == cases["chat_prompt"]["text"]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == cases["chat_prompt"]["ids"]
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_start|>assistant\n")
    assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id) == (151666, 151643, 151643)


def test_decode_generation_cuts_at_eos_and_drops_masks(real_dir):
    tok = DreamTokenizer.from_model_dir(real_dir, DreamConfig.from_model_dir(real_dir))
    eos, mask = tok.eos_token_id, tok.mask_token_id
    prompt, body, junk = tok.encode("x ="), tok.encode(" 1 + 2"), tok.encode(" junk after eos")
    row0 = prompt + body + [eos] + junk
    row1 = prompt + body[:1] + [mask] + body[1:] + [eos]
    row1 += [mask] * (len(row0) - len(row1))
    assert tok.decode_generation(np.array([row0, row1]), len(prompt)) == [" 1 + 2", " 1 + 2"]


def test_tokenizer_errors(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(TINY / "model", model_dir)
    for name in ("tokenizer.json", "vocab.json"):
        (model_dir / name).unlink()
    with pytest.raises(JaxportError, match=r"has neither tokenizer.json nor vocab.json"):
        tiny_tokenizer(model_dir)
    tok = tiny_tokenizer(TINY / "model")
    tok.chat_template = None
    with pytest.raises(JaxportError, match=r"no chat_template in tokenizer_config.json"):
        tok.apply_chat_template(CHAT)
