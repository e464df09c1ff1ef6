"""Synthetic problems whose answers can be checked exactly, to train a small Dream and judge its decoding.

Two kinds, prompt -> answer of varying length (the prompt ends with `=`):

    sort 83150=          -> 01358              (2 to 10 distinct digits, in ascending order)
    sort hat cat egg=    ->  cat egg hat       (2 to 6 distinct words of ten, in alphabetical order; each
                                                keeps its leading space, so the answer's tokens are the prompt's)

Sorting needs the whole input at every output position (an item's place is the number of smaller
items), so the answer tokens depend on each other, as a fast decoder's parallel unmasking must respect.
The items are distinct: with repeats allowed (2 to 10 digits), 3000 steps of the `task-demo` recipe
reached 27% exact match on digits and 48% on words, every error a repeated item counted once too
often or too rarely. Reversing words (2 to 5) and adding two numbers below 100 learned more slowly
still: after 1200 steps of batch 32 (32-token span) they reached 3% and 0% where sorting reached 41-56%.

`train_and_test` draws a training set and a held-out test set (no test prompt occurs in training),
`write_problems` saves them as the JSONL `jaxport dream train` reads, and `evaluate` decodes the
prompts and scores exact matches, overall and per kind (`demo_test_problems` are the held-out
problems of the `task-demo` preset).
"""

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxport.errors import JaxportError

KINDS = ("sort_digits", "sort_words")
DEMO_TRAIN_PROBLEMS = 100_000  # the training set of `jaxport dream train --preset task-demo` (seed 0)
WORDS = ("apple", "bird", "cat", "dog", "egg", "fish", "goat", "hat", "ice", "jar")


@dataclasses.dataclass(frozen=True)
class Problem:
    kind: str
    prompt: str
    answer: str


def make_problem(rng: np.random.Generator, kind: str) -> Problem:
    if kind == "sort_digits":
        digits = "".join(str(d) for d in rng.choice(10, int(rng.integers(2, 11)), replace=False))
        return Problem(kind, f"sort {digits}=", "".join(sorted(digits)))
    if kind == "sort_words":
        words = [WORDS[i] for i in rng.choice(len(WORDS), int(rng.integers(2, 7)), replace=False)]
        return Problem(kind, f"sort {' '.join(words)}=", "".join(" " + w for w in sorted(words)))
    raise JaxportError(f"unknown task kind {kind!r}; choose from {', '.join(KINDS)}")


def make_problems(count: int, seed: int, exclude: set[str] = frozenset(), kinds=KINDS) -> list[Problem]:
    """`count` distinct problems, the kinds in turn, none whose prompt is in `exclude`."""
    rng = np.random.default_rng(seed)
    problems, seen = [], set(exclude)
    while len(problems) < count:
        problem = make_problem(rng, kinds[len(problems) % len(kinds)])
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            problems.append(problem)
    return problems


def write_problems(problems: list[Problem], path: str | Path) -> Path:
    """JSONL of `{"prompt", "completion", "kind"}`, the SFT format `jaxport dream train` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"prompt": p.prompt, "completion": p.answer, "kind": p.kind}) + "\n" for p in problems)
    )
    return path


def read_problems(path: str | Path) -> list[Problem]:
    path = Path(path)
    if not path.is_file():
        raise JaxportError(f"task file {path}: no such file")
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            item = json.loads(line)
            problems.append(Problem(item.get("kind", "?"), item["prompt"], item["completion"]))
        except (json.JSONDecodeError, KeyError, AttributeError):
            raise JaxportError(f'{path}:{number}: expected {{"prompt", "completion", "kind"}}') from None
    return problems


def train_and_test(n_train: int, n_test: int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """A training set and a held-out test set (no test prompt occurs in training), both from `seed`; the
    first k test problems are the same for every `n_test` >= k."""
    train = make_problems(n_train, seed)
    return train, make_problems(n_test, seed + 1, exclude={p.prompt for p in train})


def demo_test_problems(count: int = 256, seed: int = 0) -> list[Problem]:
    """Held-out problems of the `task-demo` preset trained with `seed`."""
    return train_and_test(DEMO_TRAIN_PROBLEMS, count, seed)[1]


def evaluate(
    model,
    tokenizer,
    problems: list[Problem],
    *,
    gen_len: int = 128,
    batch_size: int = 64,
    generate: Callable | None = None,
    **sampling,
) -> tuple[dict, list[str]]:
    """(scores, completions) of `model` on `problems`: each batch of prompts is left-padded to the longest
    prompt of all problems (one compiled shape), followed by `gen_len` masks, and decoded.

    By default the decoder is exact (`steps = gen_len`, one token per step, `alg="entropy"`, greedy);
    `sampling` overrides `diffusion_generate`'s arguments, and `generate(input_ids, attention_mask) ->
    sequences [B, prompt + gen_len]` replaces it altogether (e.g. a faster decoder being judged).
    """
    sampling = {"steps": gen_len, "alg": "entropy", **sampling}
    if generate is None:

        def generate(input_ids, attention_mask):
            return model.diffusion_generate(
                input_ids, attention_mask, max_new_tokens=gen_len, return_dict_in_generate=False, **sampling
            )

    width = max(len(tokenizer.encode(p.prompt)) for p in problems)
    completions = []
    for first in range(0, len(problems), batch_size):
        input_ids, attention_mask = tokenizer([p.prompt for p in problems[first : first + batch_size]], pad_to=width)
        sequences = np.asarray(jax.device_get(generate(input_ids, attention_mask)))
        completions += tokenizer.decode_generation(sequences, width)
    return score(problems, completions), completions


def score(problems: list[Problem], completions: list[str]) -> dict:
    """Exact-match accuracy of `completions` (the decoded answers, cut at end-of-text), overall and per kind."""
    if len(problems) != len(completions):
        raise JaxportError(f"{len(completions)} completions for {len(problems)} problems")
    right = [c == p.answer for p, c in zip(problems, completions)]
    result = {"exact_match": float(np.mean(right)), "problems": len(problems)}
    for kind in sorted({p.kind for p in problems}):
        hits = [r for p, r in zip(problems, right) if p.kind == kind]
        result[f"exact_match/{kind}"] = float(np.mean(hits))
    return result
