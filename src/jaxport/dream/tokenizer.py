"""Dream / Qwen2 tokenizer from a model directory, its chat template, and decoding of generations.

Uses `tokenizer.json` when the directory has one. Official Dream directories ship only the slow
tokenizer's `vocab.json` + `merges.txt` (remote class `DreamTokenizer`, a copy of the slow
`Qwen2Tokenizer`); the same byte-level BPE is then assembled with the `tokenizers` library.
"""

import json
from pathlib import Path

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import AddedToken

from jaxport.dream.config import DreamConfig
from jaxport.errors import JaxportError

# Qwen2's pre-tokenization split (tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# DiffuCoder marks the unused tail of the canvas with this token; Dream uses eos.
DIFFUCODER_PAD = "<|dlm_pad|>"


def _slow_qwen2_tokenizer(model_dir: Path, added: dict[int, dict]) -> Tokenizer:
    vocab, merges = model_dir / "vocab.json", model_dir / "merges.txt"
    for path in (vocab, merges):
        if not path.is_file():
            raise JaxportError(f"{model_dir} has neither tokenizer.json nor {path.name}")
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges), continuing_subword_prefix="",
                                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    for token_id in sorted(added):
        entry = added[token_id]
        token = AddedToken(entry["content"], single_word=entry.get("single_word", False),
                           lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                           normalized=entry.get("normalized", False), special=entry.get("special", True))
        tok.add_tokens([token])
        if tok.token_to_id(entry["content"]) != token_id:
            raise JaxportError(f"{model_dir / 'tokenizer_config.json'}: added token {entry['content']!r} "
                               f"should have id {token_id} but vocab.json leaves it at "
                               f"{tok.token_to_id(entry['content'])}")
    return tok


class DreamTokenizer:
    """Encode prompts (left-padded batches), apply the chat template, decode generated spans."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, config: DreamConfig, special: dict):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_id = config.eos_token_id
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        self.mask_token_id = config.mask_token_id
        self.special = special  # bos/eos/pad/mask token strings for the chat template
        dlm_pad = tokenizer.token_to_id(DIFFUCODER_PAD)
        self.stop_ids = {self.eos_token_id} | ({dlm_pad} if dlm_pad is not None else set())

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: DreamConfig) -> "DreamTokenizer":
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        added = {int(k): v for k, v in tok_config.get("added_tokens_decoder", {}).items()}
        if (model_dir / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        else:
            tokenizer = _slow_qwen2_tokenizer(model_dir, added)
        if tokenizer.id_to_token(config.mask_token_id) is None:
            raise JaxportError(f"{model_dir}: the tokenizer has no token with the config's mask_token_id "
                               f"{config.mask_token_id}")
        special = {k: v if isinstance(v, str) else v.get("content") for k, v in tok_config.items()
                   if k in ("bos_token", "eos_token", "pad_token", "mask_token", "unk_token") and v}
        return cls(tokenizer, tok_config.get("chat_template"), config, special)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def __call__(self, texts: list[str] | str, pad_to: int | None = None):
        """Left-padded `(input_ids [B, L], attention_mask [B, L])` as int32 numpy arrays; `L` is the
        longest prompt, or `pad_to` (padding is invisible to the model, so one length serves every batch)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        encoded = [self.encode(t) for t in texts]
        longest = max(len(ids) for ids in encoded)
        if longest == 0:
            raise JaxportError("every prompt is empty after tokenization")
        if pad_to is not None and pad_to < longest:
            raise JaxportError(f"a prompt has {longest} tokens, more than pad_to={pad_to}")
        length = longest if pad_to is None else pad_to
        input_ids = np.full((len(texts), length), self.pad_token_id, np.int32)
        attention_mask = np.zeros((len(texts), length), np.int32)
        for row, ids in enumerate(encoded):
            if ids:
                input_ids[row, length - len(ids):] = ids
                attention_mask[row, length - len(ids):] = 1
        return input_ids, attention_mask

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False):
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's Jinja chat template,
        as transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
        if not self.chat_template:
            raise JaxportError("this tokenizer has no chat_template in tokenizer_config.json")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)

        def raise_exception(message):
            raise JaxportError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except jinja2.TemplateError as err:
            raise JaxportError(f"chat template failed: {err}") from None
        return self.encode(text) if tokenize else text

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_generation(self, sequences, prompt_length: int, skip_special_tokens: bool = True) -> list[str]:
        """Text of each row's generated span `sequences[:, prompt_length:]`: cut at the first eos
        (or DiffuCoder's `<|dlm_pad|>`), leftover mask tokens dropped."""
        texts = []
        for row in np.asarray(sequences)[:, prompt_length:]:
            ids = []
            for token in row.tolist():
                if token in self.stop_ids:
                    break
                if token != self.mask_token_id:
                    ids.append(token)
            texts.append(self.decode(ids, skip_special_tokens=skip_special_tokens))
        return texts
