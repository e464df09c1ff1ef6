"""Upstream's `evaluate` for TRM: run each batch to the last ACT step, sum the final metrics per set
(the loop over sets and evaluators is `Trainer.evaluate`)."""

from jaxport.distributed import fetch_replicated
from jaxport.trm.model import TRM


def run_to_halt(model: TRM, batch: dict, on_step=None):
    """Fresh carry, ACT calls until every row halts (in eval mode: exactly halt_max_steps).

    Returns the final `(carry, loss, metrics, outputs)` and the number of calls made.
    `on_step(step, carry, loss, metrics, outputs)` sees every call.
    """
    carry = model.initial_carry(batch)
    num_steps = 0
    while True:
        carry, loss, metrics, outputs, all_finish = model(carry, batch)
        if on_step is not None:
            on_step(num_steps, carry, loss, metrics, outputs)
        num_steps += 1
        if bool(fetch_replicated(all_finish)):
            return (carry, loss, metrics, outputs), num_steps


def reduce_eval_metrics(metric_sums: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Divide every summed metric (losses too) by the set's count, and drop the count."""
    reduced = {}
    for set_name, sums in metric_sums.items():
        sums = dict(sums)
        count = sums.pop("count")
        reduced[set_name] = {k: v / count for k, v in sums.items()}
    return reduced


def reduce_train_metrics(metrics: dict, global_batch_size: int) -> dict[str, float]:
    """upstream train_batch's logging: losses / global batch size, every other metric / max(count, 1)."""
    values = {k: float(v) for k, v in metrics.items()}
    count = max(values["count"], 1)
    return {k: v / (global_batch_size if k.endswith("loss") else count) for k, v in values.items()}
