"""Training rows for Dream: fixed-length token rows and the positions the diffusion objective may mask.

A text file (pretraining) is one token stream ending with end-of-text, cut into `seq_len`-token rows;
every position may be masked. A JSONL file (supervised fine-tuning) gives one row per line,
`{"prompt": ..., "completion": ...}` (wrapped in the chat template with `chat=True`) or
`{"messages": [...]}` ending with the assistant's turn (always templated). Prompt tokens are never
masked. The completion is followed by end-of-text padding to the end of the row, and that padding
is part of the response, as Dream is trained: the model learns where its answer ends.

With `response_len`, every row has the same response span: the prompt is left-padded to
`seq_len - response_len` tokens, the padding invisible to the model as in batched generation.
Without it, prompt and response fill the row from the left.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxport.dream.tokenizer import DreamTokenizer
from jaxport.errors import JaxportError


@dataclasses.dataclass
class Rows:
    input_ids: np.ndarray  # [N, L] int32
    attention_mask: np.ndarray  # [N, L] int32, 0 on left padding
    response_mask: np.ndarray  # [N, L] bool, the positions the objective may mask

    def __len__(self) -> int:
        return len(self.input_ids)

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {field.name: getattr(self, field.name)[index] for field in dataclasses.fields(self)}


def sft_texts(tokenizer: DreamTokenizer, item, chat: bool, where: str) -> tuple[str, str]:
    """(prompt text, completion text) of one JSONL item."""
    if isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
        messages = item["messages"]
        if not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
            raise JaxportError(f"{where}: the last message must be the assistant's answer to learn")
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        if not full.startswith(prompt):
            raise JaxportError(
                f"{where}: the chat template does not render the conversation as its prompt followed by the answer"
            )
        return prompt, full[len(prompt) :]
    if isinstance(item, dict) and isinstance(item.get("prompt"), str) and isinstance(item.get("completion"), str):
        if not chat:
            return item["prompt"], item["completion"]
        messages = [{"role": "user", "content": item["prompt"]}, {"role": "assistant", "content": item["completion"]}]
        return sft_texts(tokenizer, {"messages": messages}, chat, where)
    keys = sorted(item) if isinstance(item, dict) else type(item).__name__
    raise JaxportError(f'{where}: expected {{"prompt": str, "completion": str}} or {{"messages": [...]}}, got {keys}')


def sft_rows(
    path: Path, tokenizer: DreamTokenizer, seq_len: int, response_len: int | None = None, chat: bool = False
) -> Rows:
    prompt_len = None if response_len is None else seq_len - response_len
    if prompt_len is not None and not 0 < prompt_len < seq_len:
        raise JaxportError(f"response_len {response_len} must lie between 1 and seq_len - 1 ({seq_len - 1})")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise JaxportError(f"{where}: not JSON ({err})") from None
        prompt_text, completion_text = sft_texts(tokenizer, item, chat, where)
        prompt, completion = tokenizer.encode(prompt_text), tokenizer.encode(completion_text)
        if not prompt:
            raise JaxportError(f"{where}: the prompt is empty")
        if prompt_len is None and len(prompt) + len(completion) > seq_len:
            raise JaxportError(
                f"{where}: prompt ({len(prompt)} tokens) + completion ({len(completion)} tokens) "
                f"is longer than the context seq_len={seq_len}"
            )
        if prompt_len is not None and (len(prompt) > prompt_len or len(completion) > response_len):
            raise JaxportError(
                f"{where}: prompt ({len(prompt)} tokens) + completion ({len(completion)} tokens) "
                f"does not fit the context seq_len={seq_len}, of which the prompt may take "
                f"{prompt_len} and the completion response_len={response_len}"
            )
        rows.append((prompt, completion))
    if not rows:
        raise JaxportError(f"{path}: no examples")
    input_ids = np.full((len(rows), seq_len), tokenizer.eos_token_id, np.int32)
    attention_mask = np.ones((len(rows), seq_len), np.int32)
    response_mask = np.zeros((len(rows), seq_len), bool)
    for row, (prompt, completion) in enumerate(rows):
        start = len(prompt) if prompt_len is None else prompt_len  # the first response position
        input_ids[row, : start - len(prompt)] = tokenizer.pad_token_id
        attention_mask[row, : start - len(prompt)] = 0
        input_ids[row, start - len(prompt) : start] = prompt
        input_ids[row, start : start + len(completion)] = completion
        response_mask[row, start:] = True
    return Rows(input_ids, attention_mask, response_mask)


def text_rows(path: Path, tokenizer: DreamTokenizer, seq_len: int) -> Rows:
    """The file's tokens (encoded line by line, end-of-text at the end) in rows of `seq_len`; the
    remainder that does not fill a row is dropped."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    encoded = tokenizer.tokenizer.encode_batch(lines, add_special_tokens=False)
    tokens = np.fromiter((t for e in encoded for t in e.ids), np.int32)
    tokens = np.append(tokens, np.int32(tokenizer.eos_token_id))
    n_rows = len(tokens) // seq_len
    if n_rows == 0:
        raise JaxportError(f"{path}: {len(tokens)} tokens, fewer than one row of seq_len={seq_len}")
    input_ids = tokens[: n_rows * seq_len].reshape(n_rows, seq_len)
    return Rows(input_ids, np.ones_like(input_ids), np.ones(input_ids.shape, bool))


def load_rows(
    path: str | Path, tokenizer: DreamTokenizer, *, seq_len: int, response_len: int | None = None, chat: bool = False
) -> Rows:
    """Rows from a JSONL file (`.jsonl`, SFT) or any other text file (pretraining-style chunks)."""
    path = Path(path)
    if not path.is_file():
        raise JaxportError(f"data file {path}: no such file")
    if seq_len < 2:
        raise JaxportError(f"seq_len={seq_len}: a row needs at least 2 tokens")
    if path.suffix == ".jsonl":
        return sft_rows(path, tokenizer, seq_len, response_len, chat)
    return text_rows(path, tokenizer, seq_len)


def read_texts(paths: list[str | Path]):
    """The texts of `paths` for training a tokenizer: each line of a text file; of a JSONL file, each line's
    prompt, completion, message contents or "text", apart (they are encoded apart for training)."""
    for path in map(Path, paths):
        if not path.is_file():
            raise JaxportError(f"{path}: no such file")
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if path.suffix != ".jsonl":
                    yield line
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as err:
                    raise JaxportError(f"{path}:{number}: not JSON ({err})") from None
                if not isinstance(item, dict):
                    raise JaxportError(f"{path}:{number}: expected a JSON object")
                texts = [m.get("content") for m in item.get("messages", []) if isinstance(m, dict)]
                texts += [item.get(key) for key in ("prompt", "completion", "text")]
                yield from (text for text in texts if isinstance(text, str))


class Batches:
    """Endless shuffled batches of row indices: pass `e` visits every row once, in the order of a
    permutation drawn from `(seed, e)`; a batch may span two passes. The position is two integers,
    saved with each checkpoint so that a resumed run sees the same batches."""

    def __init__(self, n_rows: int, batch_rows: int, seed: int):
        self.n_rows, self.batch_rows, self.seed = n_rows, batch_rows, seed
        self.epoch, self.position = 0, 0
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)}
        return self._orders[epoch]

    def next(self) -> np.ndarray:
        index = []
        while len(index) < self.batch_rows:
            take = self._order(self.epoch)[self.position : self.position + self.batch_rows - len(index)]
            index.extend(take.tolist())
            self.position += len(take)
            if self.position == self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
        return np.asarray(index)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
