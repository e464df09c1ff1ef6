"""The serving scheduler's decisions (`jaxport.dream.serving.scheduler.decide`), from plain data: no model."""

from jaxport.dream.serving.scheduler import Decision, Row, Running, Waiting, decide, rows_like_oldest

LANE = "dual, blocks of 4"


def static(request, rows=1, key="A"):
    return Waiting(request, rows, key)


def continuous(request, rows=1, key="A", lane=LANE):
    return Waiting(request, rows, key, lane)


def test_nothing_waits_and_nothing_runs():
    assert decide([], None, 4) == Decision()


def test_a_static_batch_is_the_oldest_and_later_requests_of_its_program_oldest_first():
    queue = [static("a"), static("b", key="B"), static("c"), static("d", 2)]
    assert decide(queue, None, 4) == Decision(admit=("a", "c", "d"), rows=4)


def test_a_static_batch_holds_at_most_max_batch_rows_passing_over_a_request_that_does_not_fit():
    queue = [static("a", 2), static("b", 3), static("c", 1), static("d", 1)]
    assert decide(queue, None, 4) == Decision(admit=("a", "c", "d"), rows=4)
    assert decide(queue[1:], None, 4).admit == ("b", "c")


def test_the_oldest_request_decides_the_mode():
    queue = [continuous("a"), static("b", key="B"), continuous("c")]
    assert decide(queue, None, 4) == Decision(admit=("a",), lane=LANE, rows=1)  # admission stops at another mode
    assert decide(queue[1:], None, 4) == Decision(admit=("b",), rows=1)


def test_a_running_batch_admits_its_lane_oldest_first_while_rows_fit_and_never_overtakes():
    queue = [continuous("a", 2), continuous("b", 2), continuous("c", 1)]
    running = Running(LANE, 4, (Row(0, "x"),))
    # three slots free: "a" joins; "b" does not fit, and "c" may not overtake it
    assert decide(queue, running, 4) == Decision(admit=("a",), lane=LANE, rows=3)
    other = [continuous("a", 1, lane="prefix"), continuous("b", 1)]
    assert decide(other, running, 4) == Decision(lane=LANE, rows=1)  # the oldest is of another lane


def test_finished_and_cancelled_rows_leave_and_free_their_slots_for_waiting_rows():
    running = Running(LANE, 2, (Row(0, "x", finished=True), Row(1, "y", cancelled=True)))
    assert decide([continuous("a", 2)], running, 2) == Decision(leave=(0, 1), admit=("a",), lane=LANE, rows=2)
    # a row still decoding stays; only its free slot is offered
    running = Running(LANE, 2, (Row(0, "x"), Row(1, "y", finished=True)))
    assert decide([continuous("a", 2), continuous("b")], running, 2) == Decision(leave=(1,), lane=LANE, rows=1)


def test_a_running_batch_whose_rows_all_left_and_that_admits_none_is_drained():
    running = Running(LANE, 2, (Row(0, "x", finished=True),))
    decision = decide([static("a")], running, 2)
    assert decision == Decision(leave=(0,), lane=LANE, rows=0)
    assert decide([static("a")], None, 2) == Decision(admit=("a",), rows=1)  # then the static request runs


def test_rows_like_oldest_counts_what_a_static_batch_could_hold():
    assert rows_like_oldest([]) == 0
    assert rows_like_oldest([static("a", 2), static("b", key="B"), static("c", 3)]) == 5
