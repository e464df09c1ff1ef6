"""Datasets of the lm-eval tasks in this folder: the held-out problems of the `task-demo` preset
(`jaxport.dream.tasks.demo_test_problems`), made when lm-eval loads the task, so they follow the split
the test model was trained with. `--metadata '{"problems": N}'` sets how many (default 256)."""

import functools
import random
import string

import datasets

from jaxport.dream.tasks import WORDS, Problem, demo_test_problems

# drawing the training set that the held-out problems avoid takes seconds: once for both tasks
problems_of = functools.lru_cache(demo_test_problems)


def held_out(problems: int = 256, **_) -> datasets.DatasetDict:
    """`{"prompt", "answer", "kind"}` rows: `sort 83150=` -> `01358`."""
    rows = [{"prompt": p.prompt, "answer": p.answer, "kind": p.kind} for p in problems_of(problems)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def wrong_answers(problem: Problem, count: int, rng: random.Random) -> list[str]:
    """`count` distinct wrong answers: two neighbouring items swapped, or one item replaced by an item
    the prompt does not hold."""
    digits = problem.kind == "sort_digits"
    items = list(problem.answer) if digits else problem.answer.split()
    unused = [item for item in (string.digits if digits else WORDS) if item not in items]

    def join(seq):
        return "".join(seq) if digits else "".join(" " + item for item in seq)

    pool = {join(items[:i] + [items[i + 1], items[i]] + items[i + 2 :]) for i in range(len(items) - 1)}
    pool |= {join(items[:i] + [other] + items[i + 1 :]) for i in range(len(items)) for other in unused}
    return rng.sample(sorted(pool - {problem.answer}), count)


def held_out_choices(problems: int = 256, **_) -> datasets.DatasetDict:
    """The held-out problems as multiple choice: `{"prompt", "choices", "label", "kind"}`, the right
    answer among three wrong ones at a random place."""
    rng = random.Random(0)
    rows = []
    for p in problems_of(problems):
        choices = wrong_answers(p, 3, rng)
        label = rng.randrange(4)
        choices.insert(label, p.answer)
        rows.append({"prompt": p.prompt, "choices": choices, "label": label, "kind": p.kind})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
