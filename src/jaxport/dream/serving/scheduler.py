"""Which rows run next: a pure function of the queue and the running batch (plain data in, a `Decision` out), called
by the engine (`jaxport.dream.serving.engine`) whenever nothing runs and at every block boundary of a running batch.

* Static batching (a request whose `lane` is None): when nothing runs, the oldest waiting request runs together
  with every later one of an equal `key` (its compiled program), oldest first, as many as fit in `max_batch` rows
  (a request that does not fit is passed over, not the ones after it). The batch runs to its end.
* Continuous batching (a request with a `lane`: block-wise with the dual cache): the running batch's rows that
  finished (end-of-text, a stop string, `max_tokens`, or their last block) or whose client went away leave; then
  waiting requests of the lane join, oldest first, while their rows fit in the free slots. Admission stops at the
  first waiting request that is of another lane or does not fit, so a request never overtakes an older one; a lane
  whose rows all left and that admits none is drained, and the oldest waiting request decides what runs next.
"""

import dataclasses
from collections.abc import Hashable, Sequence


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A request in the queue (oldest first): `rows` rows of one compiled program (`key`); `lane` is where
    continuous batching runs it, None for static batching."""

    request: Hashable
    rows: int
    key: Hashable
    lane: Hashable | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """A row of the running batch after its last block call: its slot, its request, whether its text is finished
    and whether its client went away."""

    slot: int
    request: Hashable
    finished: bool = False
    cancelled: bool = False


@dataclasses.dataclass(frozen=True)
class Running:
    """A running batch: its lane, its number of slots and the rows that hold one."""

    lane: Hashable
    size: int
    rows: tuple[Row, ...] = ()


@dataclasses.dataclass(frozen=True)
class Decision:
    """What runs next: the slots whose rows leave, the requests that start (oldest first), and where: the lane of a
    running batch they join, or None for a static batch of `admit` alone. `rows` is the number of rows the next call
    runs; a running batch with none is drained."""

    leave: tuple[int, ...] = ()
    admit: tuple[Hashable, ...] = ()
    lane: Hashable | None = None
    rows: int = 0


def decide(waiting: Sequence[Waiting], running: Running | None, max_batch: int) -> Decision:
    """The next step (see the module docstring): at a block boundary of `running`, or with nothing running."""
    if running is not None:
        leave = tuple(row.slot for row in running.rows if row.finished or row.cancelled)
        staying = len(running.rows) - len(leave)
        admit = _join_lane(waiting, running.lane, running.size - staying)
        return Decision(leave, admit, running.lane, staying + _rows(waiting, admit))
    if not waiting:
        return Decision()
    if waiting[0].lane is not None:
        admit = _join_lane(waiting, waiting[0].lane, max_batch)
        return Decision((), admit, waiting[0].lane, _rows(waiting, admit))
    admit = _static_batch(waiting, max_batch)
    return Decision((), admit, None, _rows(waiting, admit))


def rows_like_oldest(waiting: Sequence[Waiting]) -> int:
    """Rows waiting with the oldest request's program: what a static batch started now could hold."""
    return sum(w.rows for w in waiting if w.key == waiting[0].key) if waiting else 0


def _join_lane(waiting: Sequence[Waiting], lane: Hashable, free: int) -> tuple[Hashable, ...]:
    admit = []
    for w in waiting:
        if w.lane != lane or w.rows > free:
            break
        admit.append(w.request)
        free -= w.rows
    return tuple(admit)


def _static_batch(waiting: Sequence[Waiting], max_batch: int) -> tuple[Hashable, ...]:
    key, rows, admit = waiting[0].key, 0, []
    for w in waiting:
        if w.key == key and rows + w.rows <= max_batch:
            admit.append(w.request)
            rows += w.rows
    return tuple(admit)


def _rows(waiting: Sequence[Waiting], admit: tuple) -> int:
    chosen = set(admit)
    return sum(w.rows for w in waiting if w.request in chosen)
