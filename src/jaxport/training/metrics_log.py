"""What a training run shows and leaves behind: a progress bar, metrics appended to
`metrics.jsonl`, optional wandb/tensorboard, and a PNG of the learning curves."""

import json
import math
import time
from pathlib import Path

from tqdm import tqdm

from jaxport.errors import JaxportError, write_error

LOGGERS = ("jsonl", "wandb", "tensorboard")


class MetricsLog:
    """Only process 0 logs; the others get a silent log (`enabled=False`).

    A metric whose value is None was not measured at that step (e.g. accuracy when no row halted):
    `metrics.jsonl` records null, and the progress bar keeps showing the last measured value. The bar shows the
    training metrics named in `shown` (`lm_loss` shows `train/lm_loss`)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        initial_step: int = 0,
        loggers=("jsonl",),
        config: dict | None = None,
        project: str | None = None,
        name: str | None = None,
        enabled: bool = True,
        shown=(),
        progress: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.jsonl = self.run_dir / "metrics.jsonl"
        self._wandb = self._tensorboard = None
        self._last_time, self._last_step = time.perf_counter(), initial_step
        self._shown, self._postfix = frozenset(shown), {}
        if not enabled:
            self.bar = None
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        unknown = set(loggers) - set(LOGGERS)
        if unknown:
            raise JaxportError(f"unknown logger(s) {sorted(unknown)}: choose from {', '.join(LOGGERS)}")
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError:
                raise JaxportError(
                    "loggers=[wandb] needs `pip install wandb` (WANDB_MODE=offline works without an account)"
                ) from None
            self._wandb = wandb.init(project=project, name=name, config=config, dir=str(self.run_dir), resume="allow")
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise JaxportError(
                    "loggers=[tensorboard] needs `pip install tensorboard` and PyTorch's writer "
                    "(`pip install jaxport[torch]`)"
                ) from None
            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True) if progress else None

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        if not self.enabled:
            return
        metrics = {k: None if v is None else float(v) for k, v in metrics.items()}
        now = time.perf_counter()
        if step > self._last_step:
            metrics["steps_per_s"] = (step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_step = now, step
        try:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        except OSError as err:  # a full disk
            raise write_error(err, self.jsonl) from None
        measured = {k: v for k, v in metrics.items() if v is not None}
        if self._wandb is not None:
            self._wandb.log(measured, step=step)
        if self._tensorboard is not None:
            for k, v in measured.items():
                self._tensorboard.add_scalar(k, v, step)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self._postfix.update(
                {
                    k.split("/")[-1]: f"{v:.4g}"
                    for k, v in measured.items()
                    if k.startswith("train/") and k.split("/")[-1] in self._shown
                }
            )
            self.bar.set_postfix(self._postfix, refresh=False)

    def write(self, message: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(message)

    def close(self) -> Path | None:
        if not self.enabled:
            return None
        if self.bar is not None:
            self.bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        png = self.run_dir / "learning_curves.png"
        try:
            return plot_learning_curves(self.jsonl, png)
        except OSError as err:
            raise write_error(err, png) from None


def _smooth(ys: list[float]) -> list[float]:
    """Running mean over ~2% of the points: per-batch training metrics are noisy."""
    window = max(1, len(ys) // 50)
    if window == 1:
        return ys
    cumsum = [0.0]
    for y in ys:
        cumsum.append(cumsum[-1] + y)
    return [(cumsum[i + 1] - cumsum[max(0, i + 1 - window)]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(ys))]


def pyplot():
    """matplotlib.pyplot drawing to files (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curves(jsonl: Path, png: Path, max_panels: int = 4) -> Path | None:
    """One panel per metric family (losses, accuracies, ...) against the step."""
    if not jsonl.exists():
        return None
    plt = pyplot()
    series: dict[str, tuple[list, list]] = {}
    for line in jsonl.read_text().splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if (
                k not in ("step", "time", "steps_per_s")
                and not k.endswith("/count")
                and isinstance(v, (int, float))
                and math.isfinite(v)
            ):
                xs, ys = series.setdefault(k, ([], []))
                xs.append(row["step"])
                ys.append(v)
    groups: dict[str, list[str]] = {}
    for name in sorted(series):
        leaf = name.split("/")[-1]
        kind = "loss" if leaf.endswith("loss") else "accuracy" if "accuracy" in leaf or "pass@" in leaf else leaf
        groups.setdefault(kind, []).append(name)
    kinds = sorted(groups, key=lambda k: (k not in ("loss", "accuracy"), k))[:max_panels]
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for name in groups[kind]:
            xs, ys = series[name]
            ax.plot(xs, _smooth(ys), marker="o" if len(xs) < 30 else None, markersize=3, label=name)
        ax.set_title(kind)
        ax.set_xlabel("step")
        if kind == "loss":
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
