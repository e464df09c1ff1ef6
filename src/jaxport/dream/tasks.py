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

Held-out problems come in two splits (`SPLITS`). Sorting 2 to 10 digits has only 1013 possible answers
(sets of items), and a training set of thousands of problems holds nearly every one, so a prompt that
is merely absent from training still asks for a trained answer in a new input order: `new_orders`.
`held_out_answers()` sets aside a fixed tenth of each kind's answers of each length (none where fewer
than ten exist: the one 10-digit answer), training never draws them, and `new_answers` asks for them.

`train_and_test` draws a training set and a test split (no test prompt occurs in training),
`write_problems` saves them as the JSONL `jaxport dream train` reads, and `evaluate` decodes the
prompts and scores exact matches, overall and per kind (`demo_test_problems` are the test splits of
the `task-demo` preset).
"""

import dataclasses
import functools
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxport.errors import JaxportError

DEMO_TRAIN_PROBLEMS = 100_000  # the training set of `jaxport dream train --preset task-demo` (seed 0)
WORDS = ("apple", "bird", "cat", "dog", "egg", "fish", "goat", "hat", "ice", "jar")
# each kind's items and the numbers of them a problem sorts
ITEMS = {"sort_digits": (tuple("0123456789"), range(2, 11)), "sort_words": (WORDS, range(2, 7))}
KINDS = tuple(ITEMS)
SPLITS = ("new_orders", "new_answers")
HELD_OUT_SHARE = 10  # one answer in ten of each kind and length is never trained on
HELD_OUT_SEED = 0  # which ones: fixed, whatever the training seed


@dataclasses.dataclass(frozen=True)
class Problem:
    kind: str
    prompt: str
    answer: str


def _answer(kind: str, items) -> str:
    ordered = sorted(items)
    return "".join(ordered) if kind == "sort_digits" else "".join(" " + w for w in ordered)


def make_problem(rng: np.random.Generator, kind: str) -> Problem:
    if kind not in ITEMS:
        raise JaxportError(f"unknown task kind {kind!r}; choose from {', '.join(KINDS)}")
    items, sizes = ITEMS[kind]
    chosen = [items[i] for i in rng.choice(len(items), int(rng.integers(sizes.start, sizes.stop)), replace=False)]
    shown = "".join(chosen) if kind == "sort_digits" else " ".join(chosen)
    return Problem(kind, f"sort {shown}=", _answer(kind, chosen))


@functools.cache
def held_out_answers() -> frozenset[str]:
    """The answers no training problem has: of each kind's answers with k items, a fixed random
    `1 / HELD_OUT_SHARE` (rounded down)."""
    rng = np.random.default_rng(HELD_OUT_SEED)
    held_out = set()
    for kind, (items, sizes) in ITEMS.items():
        for size in sizes:
            answers = [_answer(kind, combo) for combo in itertools.combinations(items, size)]
            held_out.update(answers[i] for i in rng.choice(len(answers), len(answers) // HELD_OUT_SHARE, replace=False))
    return frozenset(held_out)


def make_problems(
    count: int, seed: int, exclude: set[str] = frozenset(), kinds=KINDS, keep: Callable[[Problem], bool] | None = None
) -> list[Problem]:
    """`count` distinct problems, the kinds in turn, none whose prompt is in `exclude`, each one `keep`
    accepts (all by default)."""
    rng = np.random.default_rng(seed)
    problems, seen = [], set(exclude)
    while len(problems) < count:
        problem = make_problem(rng, kinds[len(problems) % len(kinds)])
        if problem.prompt not in seen and (keep is None or keep(problem)):
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


def training_problems(count: int, seed: int = 0) -> tuple[Problem, ...]:
    """`count` training problems, none of whose answers is in `held_out_answers()`."""
    return _training_problems(count, seed)


@functools.lru_cache(maxsize=2)  # the demo's 100k problems take seconds to draw, and every test split needs them
def _training_problems(count: int, seed: int) -> tuple[Problem, ...]:
    held_out = held_out_answers()
    return tuple(make_problems(count, seed, keep=lambda p: p.answer not in held_out))


def held_out_problems(train, count: int, seed: int = 0, split: str = "new_orders") -> list[Problem]:
    """`count` problems of `split` for a model trained on `train`, none with a prompt of `train`:
    `new_orders`, answers `train` has (its items in a new order); `new_answers`, answers it never has
    (`held_out_answers()`). The first k problems are the same for every `count` >= k."""
    if split not in SPLITS:
        raise JaxportError(f"unknown test split {split!r}; choose from {', '.join(SPLITS)}")
    prompts, trained = {p.prompt for p in train}, {p.answer for p in train}
    answers = trained if split == "new_orders" else held_out_answers() - trained
    if not answers:
        raise JaxportError(
            f"no {split} test problems: the training set has {len(trained)} answers, of them "
            f"{len(trained & held_out_answers())} of the {len(held_out_answers())} held out"
        )
    offset = 1 + SPLITS.index(split)
    return make_problems(count, seed + offset, exclude=prompts, keep=lambda p: p.answer in answers)


def train_and_test(n_train: int, n_test: int, seed: int = 0, split: str = "new_orders"):
    """A training set and a test set of `split`, both from `seed`."""
    train = training_problems(n_train, seed)
    return train, held_out_problems(train, n_test, seed, split)


def demo_test_problems(count: int = 256, seed: int = 0, split: str = "new_orders") -> list[Problem]:
    """Test problems of `split` for the `task-demo` preset trained with `seed`."""
    return train_and_test(DEMO_TRAIN_PROBLEMS, count, seed, split)[1]


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

    By default the decoder is exact (`steps = gen_len`, one token per step, `alg="entropy"`, greedy) and a batch
    stops once every row's text has ended (`diffusion_generate`'s early stop; `early_stop=False` turns it off);
    `sampling` overrides `diffusion_generate`'s arguments, and `generate(input_ids, attention_mask) ->
    sequences [B, prompt + gen_len]` replaces it altogether (e.g. a faster decoder being judged).
    """
    sampling = {"steps": gen_len, "alg": "entropy", **sampling}
    if generate is None:

        def generate(input_ids, attention_mask):
            return model.diffusion_generate(
                input_ids,
                attention_mask,
                max_new_tokens=gen_len,
                return_dict_in_generate=False,
                stop_token_ids=tokenizer.stop_ids,
                **sampling,
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
