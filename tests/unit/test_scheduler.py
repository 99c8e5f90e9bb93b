"""The controller's scheduling state: admission, re-issue, rollback after a trainer restore."""

from __future__ import annotations

from areal_async.scheduler import SchedulerState


def _state(max_staleness: int = 1, batch_size: int = 2, max_inflight: int = 100) -> SchedulerState:
    return SchedulerState(max_staleness=max_staleness, batch_size=batch_size, max_inflight=max_inflight)


def _issue_all(state: SchedulerState) -> list[str]:
    ids = []
    index = len(state.step_tasks) * 100 + state.total_issued
    while state.can_issue():
        issue = state.take_retry() or state.take_new(0, index)
        ids.append(issue.task_id)
        index += 1
    return ids


def test_admission_issues_max_staleness_plus_one_batches_at_version_zero() -> None:
    """With v = 0 the controller may run max_staleness + 1 batches ahead, no more."""
    state = _state(max_staleness=1, batch_size=2)
    assert len(_issue_all(state)) == (1 + 0 + 1) * 2


def test_a_new_served_version_opens_one_more_batch() -> None:
    """Each served version admits B more tasks."""
    state = _state(max_staleness=1, batch_size=2)
    _issue_all(state)
    state.on_trained(1, ["e0-i0", "e0-i1"])
    assert not state.can_issue(), "training alone does not open admission; serving the new version does"
    state.on_served(1)
    assert len(_issue_all(state)) == 2


def test_max_inflight_caps_issued_minus_trained() -> None:
    """issued - trained < max_inflight holds even with a large staleness bound."""
    state = _state(max_staleness=10, batch_size=4, max_inflight=3)
    assert len(_issue_all(state)) == 3
    state.on_trained(1, ["e0-i0"])
    assert len(_issue_all(state)) == 1


def test_failed_task_is_reissued_with_a_higher_attempt() -> None:
    """A stale group frees its slot and comes back with attempt + 1, ahead of new rows."""
    state = _state(max_staleness=0, batch_size=2)
    first = _issue_all(state)
    assert state.on_failed(first[0], 0, 0, 0, "stale") is True
    assert state.issued == 1
    again = state.take_retry()
    assert again is not None and again.task_id == first[0] and again.attempt == 1
    assert state.issued == 2


def test_filtered_task_is_not_reissued() -> None:
    """Dynamic sampling drops the group; the feed moves on to new prompts."""
    state = _state()
    ids = _issue_all(state)
    assert state.on_failed(ids[0], 0, 0, 0, "filtered") is False
    assert state.take_retry() is None
    assert state.failures == {"filtered": 1}


def test_late_failure_of_an_older_attempt_is_ignored() -> None:
    """A duplicate failure of attempt 0 after attempt 1 was issued changes nothing."""
    state = _state()
    ids = _issue_all(state)
    state.on_failed(ids[0], 0, 0, 0, "future")
    state.take_retry()
    issued = state.issued
    assert state.on_failed(ids[0], 0, 0, 0, "future") is False
    assert state.issued == issued


def test_repeated_step_number_rolls_back_lost_steps() -> None:
    """A trainer restored to step 1 repeats step 2: steps >= 2 are uncounted first."""
    state = _state(max_staleness=4, batch_size=2)
    _issue_all(state)
    state.on_trained(1, ["a", "b"])
    state.on_trained(2, ["c", "d"])
    state.on_trained(3, ["e", "f"])
    assert state.trained == 6
    rolled = state.on_trained(2, ["c", "e"])
    assert rolled == 4
    assert state.trained == 4
    assert state.step_tasks == {1: ["a", "b"], 2: ["c", "e"]}


def test_state_round_trips_through_plain_data() -> None:
    """to_dict/from_dict keep every counter, the retry queue and attempts."""
    state = _state()
    ids = _issue_all(state)
    state.on_failed(ids[1], 0, 1, 0, "stale")
    state.on_trained(1, [ids[0]])
    state.on_served(1)
    restored = SchedulerState.from_dict(state.to_dict(), max_staleness=1, batch_size=2, max_inflight=100)
    assert restored.to_dict() == state.to_dict()


def test_only_failures_of_tasks_in_flight_with_their_fields_are_accepted() -> None:
    """A failure names a task in flight with its epoch, index and current attempt, or it is refused."""
    state = _state()
    issue = state.take_new(0, 7)
    assert state.check_failed(issue.task_id, 0, 7, 0) == ""
    assert "not in flight" in state.check_failed("e0-i999999", 0, 999999, 0)
    assert "index" in state.check_failed(issue.task_id, 0, 8, 0)
    assert "attempt" in state.check_failed(issue.task_id, 0, 7, 3)
    assert state.on_failed(issue.task_id, 0, 7, 0, "stale")
    assert "not in flight" in state.check_failed(issue.task_id, 0, 7, 0), "a failure is acted on once"
    retry = state.take_retry()
    assert retry is not None and retry.attempt == 1
    assert state.check_failed(issue.task_id, 0, 7, 1) == ""


def test_only_steps_of_tasks_in_flight_are_accepted_and_rollback_puts_them_back() -> None:
    """A step may name tasks in flight, or tasks of the steps it rolls back; nothing else."""
    state = _state(max_staleness=1, batch_size=2)
    ids = _issue_all(state)
    assert state.check_trained(1, ids[:2]) == ""
    assert "not in flight" in state.check_trained(1, ["forged-1", ids[0]])
    assert "twice" in state.check_trained(1, [ids[0], ids[0]])
    state.on_trained(1, ids[:2])
    assert "not in flight" in state.check_trained(2, ids[:2]), "trained tasks are no longer in flight"
    assert state.check_trained(1, ids[:2]) == "", "a repeated step number may retrain what it rolls back"
    state.on_trained(1, [ids[1], ids[2]])  # a restored trainer batches the redelivered groups anew
    assert state.check_failed(ids[0], 0, int(ids[0].split("-i")[1]), 5) == "", "rolled back: any attempt"


def test_state_saved_without_in_flight_records_is_not_checked() -> None:
    """A state written before in-flight tracking restores with the checks off, not refusing everything."""
    state = _state()
    state.take_new(0, 1)
    data = state.to_dict()
    del data["inflight"]
    restored = SchedulerState.from_dict(data, max_staleness=1, batch_size=2, max_inflight=100)
    assert restored.inflight is None and restored.check_failed("anything", 0, 5, 9) == ""
    again = SchedulerState.from_dict(state.to_dict(), max_staleness=1, batch_size=2, max_inflight=100)
    assert again.inflight == {"e0-i1": [0, 1, 0]}


def test_a_restored_trainer_recycles_a_group_of_a_lost_step_before_repeating_that_step() -> None:
    """Trainer restored at version 1 after committing steps 2 and 3: it fails a redelivered group of
    step 3 as ``future`` before it repeats any step. The task leaves step 3 and ``trained``, is re-issued
    with the next attempt, and the repeated step 2 later rolls back the rest without counting it twice.
    The same failure from a trainer that still has step 3, or without a trainer version, is refused."""
    state = _state(max_staleness=4, batch_size=2)
    ids = _issue_all(state)
    state.on_trained(1, ids[0:2])
    state.on_trained(2, ids[2:4])
    state.on_trained(3, ids[4:6])
    issued, lost = state.issued, ids[5]
    index = int(lost.split("-i")[1])
    assert "not in flight" in state.check_failed(lost, 0, index, 0, trainer_version=3)
    assert "not in flight" in state.check_failed(lost, 0, index, 0)
    assert "not in flight" in state.check_failed(lost, 0, index + 1, 0, trainer_version=1), "wrong row"
    assert state.check_failed(lost, 0, index, 0, trainer_version=1) == ""
    assert state.on_failed(lost, 0, index, 0, "future", trainer_version=1)
    assert (state.trained, state.issued, state.step_tasks[3]) == (5, issued - 1, [ids[4]])
    retry = state.take_retry()
    assert retry is not None and (retry.task_id, retry.attempt) == (lost, 1)
    state.on_trained(2, [ids[2], ids[4]])  # the restored trainer repeats step 2
    assert state.trained == 4 and state.step_tasks == {1: ids[0:2], 2: [ids[2], ids[4]]}
    assert state.inflight is not None and state.inflight[lost] == [0, index, 1]
    assert state.issued - state.trained == len(state.inflight)
