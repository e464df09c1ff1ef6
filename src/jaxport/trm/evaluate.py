"""Upstream's `evaluate` for TRM: run each batch to the last ACT step, sum the final metrics per set,
feed the evaluators, and collect the outputs named by `eval_save_outputs`."""

from collections.abc import Callable, Iterable

import numpy as np

from jaxport.distributed import fetch_replicated
from jaxport.errors import JaxportError
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


def evaluate(
    model: TRM,
    batches: Iterable,
    evaluators=(),
    local_rows: Callable = np.asarray,
    save_keys=(),
    save_dir=None,
    is_main: bool = True,
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """`batches` yields `(set_name, batch on the devices, this process's rows of it on the host)`.

    Metrics are summed per set in float32 as upstream does, then divided by the set's count
    (`{set}/{metric}`), and the evaluators' results (e.g. ARC pass@K) added. Also returns this
    process's rows of every output or batch field named in `save_keys`, concatenated over batches.
    """
    for evaluator in evaluators:
        evaluator.begin_eval()
    wanted = set(save_keys) | {k for evaluator in evaluators for k in evaluator.required_outputs}
    sums: dict[str, dict[str, np.float32]] = {}
    saved: dict[str, list] = {}
    for set_name, batch, host_batch in batches:
        (_, _, metrics, outputs), _ = run_to_halt(model, batch)
        set_sums = sums.setdefault(set_name, {})
        for k, v in fetch_replicated(metrics).items():
            set_sums[k] = np.float32(set_sums.get(k, 0)) + np.float32(v)
        rows = {k: local_rows(v) for k, v in outputs.items() if k in wanted}
        rows |= {k: np.asarray(v) for k, v in host_batch.items() if k in wanted}
        for evaluator in evaluators:
            evaluator.update_batch(rows, rows)
        for k in save_keys:
            if k in rows:
                saved.setdefault(k, []).append(rows[k])
    result = {f"{s}/{k}": float(v) for s, m in reduce_eval_metrics(sums).items() for k, v in m.items()}
    for evaluator in evaluators:
        result |= evaluator.result(save_dir if is_main else None) or {}
    return result, {k: np.concatenate(v) for k, v in saved.items()}


def reduce_eval_metrics(metric_sums: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Divide every summed metric (losses too) by the set's count, and drop the count."""
    reduced = {}
    for set_name, sums in metric_sums.items():
        sums = dict(sums)
        count = sums.pop("count")
        reduced[set_name] = {k: v / count for k, v in sums.items()}
    return reduced


HALTED_ROW_METRICS = ("accuracy", "exact_accuracy", "q_halt_accuracy", "steps")


def reduce_train_metrics(metrics: dict, global_batch_size: int) -> dict[str, float | None]:
    """upstream train_batch's logging: losses / global batch size, every other metric / count. The
    metrics of halted rows are None (not measured) on a step where no row halted, where upstream
    logs 0."""
    values = {k: float(v) for k, v in metrics.items()}
    count = values["count"]
    return {
        k: (
            v / global_batch_size
            if k.endswith("loss")
            else None
            if count == 0 and k in HALTED_ROW_METRICS
            else v / max(count, 1)
        )
        for k, v in values.items()
    }


def make_evaluators(config, blank_identifier_id: int) -> list:
    """The run config's `evaluators` (upstream's arc@ARC), on the first test dataset."""
    evaluators = []
    for spec in config.evaluators:
        if spec.name.split("@")[-1] != "ARC":
            raise JaxportError(f"unknown evaluator {spec.name!r} (jaxport has arc@ARC)")
        from jaxport.trm.arc_eval import ARCEvaluator

        data_path = (config.data_paths_test or config.data_paths)[0]
        evaluators.append(ARCEvaluator(data_path, blank_identifier_id=blank_identifier_id, **spec.model_extra))
    return evaluators
