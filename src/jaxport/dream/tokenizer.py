"""Dream / Qwen2 tokenizer from a model directory, its chat template, and decoding of generations.

Uses `tokenizer.json` when the directory has one. Official Dream directories ship only the slow
tokenizer's `vocab.json` + `merges.txt` (remote class `DreamTokenizer`, a copy of the slow
`Qwen2Tokenizer`); the same byte-level BPE is then assembled with the `tokenizers` library.
`train_tokenizer` trains a small byte-level BPE of the same kind, with Dream's special tokens.
"""

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxport.dream.config import DreamConfig
from jaxport.errors import JaxportError

# Qwen2's pre-tokenization split (tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DiffuCoder marks the unused tail of the canvas with this token; Dream uses eos.
DIFFUCODER_PAD = "<|dlm_pad|>"


# Dream's added tokens in Dream's order, with its `special` flags (Dream-v0's tokenizer_config.json).
# They follow the BPE vocabulary: the last two are bos and the mask token.
DREAM_ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<|beginoftext|>", True),
    ("<|mask|>", True),
)
DREAM_SPECIAL = {
    "bos_token": "<|beginoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "mask_token": "<|mask|>",
}

# Dream's chat template (ChatML, default system prompt) without its tool-calling branches.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Files of a tokenizer directory (no code: remote tokenizer classes are not jaxport's to ship).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


def _byte_level_pipeline(tok: Tokenizer) -> Tokenizer:
    """Qwen2's normalizer, pre-tokenizer (split, then bytes as characters) and decoder."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _slow_qwen2_tokenizer(model_dir: Path, added: dict[int, dict]) -> Tokenizer:
    vocab, merges = model_dir / "vocab.json", model_dir / "merges.txt"
    for path in (vocab, merges):
        if not path.is_file():
            raise JaxportError(f"{model_dir} has neither tokenizer.json nor {path.name}")
    tok = _byte_level_pipeline(
        Tokenizer(
            models.BPE.from_file(
                str(vocab),
                str(merges),
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
    )
    for token_id in sorted(added):
        entry = added[token_id]
        token = AddedToken(
            entry["content"],
            single_word=entry.get("single_word", False),
            lstrip=entry.get("lstrip", False),
            rstrip=entry.get("rstrip", False),
            normalized=entry.get("normalized", False),
            special=entry.get("special", True),
        )
        tok.add_tokens([token])
        if tok.token_to_id(entry["content"]) != token_id:
            raise JaxportError(
                f"{model_dir / 'tokenizer_config.json'}: added token {entry['content']!r} "
                f"should have id {token_id} but vocab.json leaves it at "
                f"{tok.token_to_id(entry['content'])}"
            )
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
            raise JaxportError(
                f"{model_dir}: the tokenizer has no token with the config's mask_token_id {config.mask_token_id}"
            )
        special = {
            k: v if isinstance(v, str) else v.get("content")
            for k, v in tok_config.items()
            if k in ("bos_token", "eos_token", "pad_token", "mask_token", "unk_token") and v
        }
        return cls(tokenizer, tok_config.get("chat_template"), config, special)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def __call__(self, texts: list[str] | str, pad_to: int | None = None):
        """Left-padded `(input_ids [B, L], attention_mask [B, L])` as int32 numpy arrays; `L` is the
        longest prompt, or `pad_to` (padding is invisible to the model, so one length serves every batch)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        return self.pad([self.encode(t) for t in texts], pad_to)

    def pad(self, encoded: list[list[int]], pad_to: int | None = None):
        """Encoded prompts as `__call__` returns texts: left-padded `(input_ids, attention_mask)`."""
        longest = max(len(ids) for ids in encoded)
        if longest == 0:
            raise JaxportError("every prompt is empty after tokenization")
        if pad_to is not None and pad_to < longest:
            raise JaxportError(f"a prompt has {longest} tokens, more than pad_to={pad_to}")
        length = longest if pad_to is None else pad_to
        input_ids = np.full((len(encoded), length), self.pad_token_id, np.int32)
        attention_mask = np.zeros((len(encoded), length), np.int32)
        for row, ids in enumerate(encoded):
            if ids:
                input_ids[row, length - len(ids) :] = ids
                attention_mask[row, length - len(ids) :] = 1
        return input_ids, attention_mask

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False):
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's Jinja chat template,
        as transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
        if not self.chat_template:
            raise JaxportError("this tokenizer has no chat_template in tokenizer_config.json")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)

        def raise_exception(message):
            raise JaxportError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
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


def train_tokenizer(
    texts: Iterable[str], output_dir: str | Path, vocab_size: int = 4096, min_frequency: int = 2
) -> Path:
    """Train a byte-level BPE like Qwen2's on `texts` and save it in the Hugging Face layout.

    `vocab_size` counts every token: the 256 byte characters, the learned merges (fewer when the
    texts run out of pairs seen `min_frequency` times) and Dream's 24 added tokens, which follow
    the BPE vocabulary in Dream's order (`<|endoftext|>` first, `<|mask|>` last). Writes
    `tokenizer.json`, `tokenizer_config.json` (with a ChatML chat template) and `special_tokens_map.json`.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(DREAM_ADDED_TOKENS):
        raise JaxportError(
            f"vocab_size {vocab_size} is too small: the 256 bytes and Dream's "
            f"{len(DREAM_ADDED_TOKENS)} added tokens alone take {len(alphabet) + len(DREAM_ADDED_TOKENS)}"
        )
    tok = _byte_level_pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(DREAM_ADDED_TOKENS),
        min_frequency=min_frequency,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    first_added = tok.get_vocab_size()
    tok.add_tokens([AddedToken(content, normalized=False, special=special) for content, special in DREAM_ADDED_TOKENS])
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(output_dir / "tokenizer.json"))
    added = {
        str(first_added + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(DREAM_ADDED_TOKENS)
    }
    extra = ["<|beginoftext|>", "<|mask|>"]
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": extra,
        **DREAM_SPECIAL,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (output_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {"additional_special_tokens": extra, **DREAM_SPECIAL}
    (output_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return output_dir


def special_token_ids(tokenizer_dir: str | Path) -> dict:
    """What a model config needs from a tokenizer directory: `vocab_size` (every token, rounded up to a
    multiple of 64) and the ids of its mask, eos, pad and bos tokens (`tokenizer_config.json` names them)."""
    tokenizer_dir = Path(tokenizer_dir)
    path, config_path = tokenizer_dir / "tokenizer.json", tokenizer_dir / "tokenizer_config.json"
    for needed in (path, config_path):
        if not needed.is_file():
            raise JaxportError(
                f"{tokenizer_dir} is not a tokenizer directory: no {needed.name} "
                "(make one with `jaxport dream tokenizer`)"
            )
    tok = Tokenizer.from_file(str(path))
    names = json.loads(config_path.read_text())
    ids = {}
    for key in ("mask_token", "eos_token", "pad_token", "bos_token"):
        name = names.get(key) or DREAM_SPECIAL[key]
        name = name["content"] if isinstance(name, dict) else name
        token_id = tok.token_to_id(name)
        if token_id is None:
            raise JaxportError(f"{path} has no token {name!r} ({key} of {config_path.name})")
        ids[f"{key}_id"] = token_id
    return {"vocab_size": -(-tok.get_vocab_size() // 64) * 64, **ids}


def copy_tokenizer_files(source_dir: str | Path, output_dir: str | Path) -> None:
    """Copy the tokenizer files of `source_dir` (those it has) into `output_dir`."""
    for name in TOKENIZER_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copyfile(Path(source_dir) / name, Path(output_dir) / name)
