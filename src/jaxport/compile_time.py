"""Seconds JAX spends tracing, lowering and compiling, from jax.monitoring's compile events: the compile time
a benchmark reports apart from its steady state. (A first call's time less a later call's is no measure of
it: on a machine whose speed drifts by a quarter within minutes that difference even goes negative.)"""

from jax import monitoring

_seconds = [0.0]  # all compilation so far in this process


def _count(event: str, seconds: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        _seconds[0] += seconds


monitoring.register_event_duration_secs_listener(_count)


def with_compile_seconds(call):
    """`(call(), seconds JAX spent compiling during it)`."""
    before = _seconds[0]
    result = call()
    return result, _seconds[0] - before
