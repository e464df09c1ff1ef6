"""Detokenisation of generated rows: each row's text as more of its canvas becomes final, cut at end-of-text, after
`max_tokens` tokens and before the first stop string, sent as the text that is new."""

import bisect

import numpy as np

from jaxport.dream.program import text_ended
from jaxport.dream.tokenizer import DreamTokenizer


def generated_ids(span: np.ndarray, stop_ids: set[int], mask_token_id: int) -> tuple[list[int], bool, bool]:
    """Token ids of a row's generated span up to its first end token or still-masked position:
    `(ids, ended at an end token (`text_ended`), reached a mask)`."""
    span = np.asarray(span)
    ends = np.isin(span, [*stop_ids, mask_token_id])
    length = int(np.argmax(ends)) if ends.any() else len(span)
    ended = bool(text_ended(span[None], np.isin(span[None], list(stop_ids)), mask_token_id)[0])
    return span[:length].tolist(), ended, length < len(span) and not ended


class RowText:
    """The text of one generated row as more of its canvas becomes final: cut at end-of-text, after
    `max_tokens` tokens and before the first `stop` string. `update` returns the text that is new."""

    def __init__(self, tokenizer: DreamTokenizer, max_tokens: int, stop: list[str]):
        self.tokenizer, self.max_tokens, self.stop = tokenizer, max_tokens, stop
        self.text, self.tokens, self.finish_reason = "", 0, None

    def update(self, span: np.ndarray, final: bool) -> str:
        if self.finish_reason is not None:
            return ""
        ids, ended, masked = generated_ids(
            span[: self.max_tokens], self.tokenizer.stop_ids, self.tokenizer.mask_token_id
        )
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, ended = text[:cut], True
            # the fewest tokens whose text covers the kept text
            ids = ids[
                : bisect.bisect_left(
                    range(len(ids) + 1),
                    cut,
                    key=lambda k: len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)),
                )
            ]
        if ended:
            self.finish_reason = "stop"
        elif final or not masked:
            self.finish_reason = "length"
        else:
            # Hold back a character still missing bytes and any tail that may begin a stop string.
            text = text.rstrip("\ufffd")
            held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - held]
        delta = text[len(self.text) :]
        self.text, self.tokens = text, len(ids)
        return delta
