"""The seconds JAX spends tracing, lowering and compiling, read from jax.monitoring's compile events (the time of a
first call less a later call's is no measure of it where the machine's speed drifts): what `jaxport dream bench`
and `bench/` report as compile time."""

from jax import monitoring

_seconds = [0.0]  # compilation in this process since `with_compile_seconds` first listened
_listening = []


def _count(event: str, seconds: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        _seconds[0] += seconds


def with_compile_seconds(call):
    """`(call(), seconds JAX spent compiling during it)`. The first call registers a jax.monitoring listener for
    the rest of the process."""
    if not _listening:
        monitoring.register_event_duration_secs_listener(_count)
        _listening.append(_count)
    before = _seconds[0]
    result = call()
    return result, _seconds[0] - before
