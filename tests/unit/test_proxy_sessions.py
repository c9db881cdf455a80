"""SessionRecorder: turns fold into prefix-extended segments with exact loss masks and logprobs."""
from __future__ import annotations

import pytest

from rlsys.proxy.sessions import SessionRecord, SessionRecorder
from rlsys.types import Turn


def turn(prompt: list[int], completion: list[int], finish: str = "stop") -> Turn:
    # Distinct, recognisable logprobs: -(token id) / 100.
    return Turn(prompt, completion, [-t / 100 for t in completion], finish)


def test_single_turn_masks_prompt_and_marks_completion():
    rec = SessionRecorder()
    rec.record("s", turn([1, 2, 3], [7, 8]))
    out = rec.pop("s")
    assert out.num_turns == 1 and out.segment_breaks == 0 and out.dropped_turns == 0
    (seg,) = out.segments
    assert seg.input_ids == [1, 2, 3, 7, 8]
    assert seg.loss_mask == [0, 0, 0, 1, 1]
    assert seg.rollout_logprobs == [0.0, 0.0, 0.0, -0.07, -0.08]
    assert seg.num_sampled == 2


def test_extending_turn_masks_new_prompt_suffix_and_marks_only_completion():
    rec = SessionRecorder()
    rec.record("s", turn([1, 2], [7, 8]))
    # Next prompt = previous segment + tool result tokens (50, 51) + generation prompt (3).
    rec.record("s", turn([1, 2, 7, 8, 50, 51, 3], [9, 10, 11]))
    out = rec.pop("s")
    assert out.num_turns == 2 and out.segment_breaks == 0
    (seg,) = out.segments
    assert seg.input_ids == [1, 2, 7, 8, 50, 51, 3, 9, 10, 11]
    assert seg.loss_mask == [0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert seg.rollout_logprobs == [0.0, 0.0, -0.07, -0.08, 0.0, 0.0, 0.0, -0.09, -0.10, -0.11]
    # The mask covers exactly the sampled ids, in order.
    assert [t for t, m in zip(seg.input_ids, seg.loss_mask) if m] == [7, 8, 9, 10, 11]


def test_prompt_equal_to_segment_extends_with_empty_suffix():
    rec = SessionRecorder()
    rec.record("s", turn([1, 2], [7]))
    rec.record("s", turn([1, 2, 7], [8]))
    (seg,) = rec.pop("s").segments
    assert seg.input_ids == [1, 2, 7, 8] and seg.loss_mask == [0, 0, 1, 1]


def test_non_extending_turn_starts_new_segment_and_counts_break():
    rec = SessionRecorder()
    rec.record("s", turn([1, 2], [7, 8]))
    # Re-tokenisation drift: the previous completion came back as [7, 80], not [7, 8].
    rec.record("s", turn([1, 2, 7, 80, 50], [9]))
    # The third turn extends the *second* segment, not the first.
    rec.record("s", turn([1, 2, 7, 80, 50, 9, 60], [10]))
    out = rec.pop("s")
    assert out.num_turns == 3 and out.segment_breaks == 1
    first, second = out.segments
    assert first.input_ids == [1, 2, 7, 8] and first.loss_mask == [0, 0, 1, 1]
    assert second.input_ids == [1, 2, 7, 80, 50, 9, 60, 10]
    assert second.loss_mask == [0, 0, 0, 0, 0, 1, 0, 1]


def test_shorter_prompt_is_a_break_not_an_extension():
    rec = SessionRecorder()
    rec.record("s", turn([1, 2, 3], [7]))
    rec.record("s", turn([1, 2], [8]))  # history truncated by the agent
    out = rec.pop("s")
    assert out.segment_breaks == 1 and [s.input_ids for s in out.segments] == [[1, 2, 3, 7], [1, 2, 8]]


def test_sessions_are_independent():
    rec = SessionRecorder()
    rec.record("a", turn([1], [2]))
    rec.record("b", turn([5], [6]))
    rec.record("a", turn([1, 2, 3], [4]))
    assert rec.pop("a").segments[0].input_ids == [1, 2, 3, 4]
    assert rec.pop("b").segments[0].input_ids == [5, 6]


def test_pop_removes_and_unknown_id_gives_empty_record():
    rec = SessionRecorder()
    rec.record("s", turn([1], [2]))
    assert "s" in rec and rec.stats["live_sessions"] == 1
    assert rec.pop("s").num_turns == 1
    assert "s" not in rec and rec.stats["live_sessions"] == 0
    again = rec.pop("s")
    assert again == SessionRecord() and again.segments == [] and again.num_turns == 0
    assert rec.pop("never-seen") == SessionRecord()


def test_popped_record_is_not_changed_by_later_turns_under_same_id():
    rec = SessionRecorder()
    rec.record("s", turn([1], [2]))
    first = rec.pop("s")
    rec.record("s", turn([1, 2, 3], [4]))
    assert first.segments[0].input_ids == [1, 2]
    assert rec.pop("s").segments[0].input_ids == [1, 2, 3, 4]


def test_least_recently_used_session_is_evicted_and_counted():
    rec = SessionRecorder(max_sessions=2)
    rec.record("a", turn([1], [2]))
    rec.record("b", turn([1], [2]))
    rec.record("a", turn([1, 2], [3]))  # "a" is now the most recently used
    rec.record("c", turn([1], [2]))  # evicts "b"
    stats = rec.stats
    counts = (stats["live_sessions"], stats["evicted_sessions"], stats["dropped_turns"], stats["late_turns"])
    assert counts == (2, 1, 0, 0)
    assert rec.pop("b") == SessionRecord()
    assert rec.pop("a").num_turns == 2
    assert rec.pop("c").num_turns == 1


def test_turns_over_the_cap_are_dropped_and_counted():
    rec = SessionRecorder(max_turns_per_session=2)
    rec.record("s", turn([1], [2]))
    rec.record("s", turn([1, 2], [3]))
    rec.record("s", turn([1, 2, 3], [4]))
    rec.record("s", turn([1, 2, 3, 4], [5]))
    assert rec.stats["dropped_turns"] == 2
    out = rec.pop("s")
    assert out.num_turns == 2 and out.dropped_turns == 2
    assert out.segments[0].input_ids == [1, 2, 3]


def test_many_sessions_stay_bounded():
    rec = SessionRecorder(max_sessions=10)
    for i in range(1000):
        rec.record(f"s{i}", turn([1], [2]))
    assert rec.stats["live_sessions"] == 10 and rec.evicted_sessions == 990
    assert rec.pop("s999").num_turns == 1 and rec.pop("s0").num_turns == 0


def test_bad_bounds_rejected():
    with pytest.raises(ValueError, match="max_sessions"):
        SessionRecorder(max_sessions=0)
    with pytest.raises(ValueError, match="max_turns_per_session"):
        SessionRecorder(max_turns_per_session=0)


# ---- request tickets: seeds of concurrent requests, late turns after a pop -----------------------


def test_tickets_number_requests_in_arrival_order_per_session_life():
    rec = SessionRecorder()
    a0, a1, b0 = rec.begin("a"), rec.begin("a"), rec.begin("b")
    assert (a0.index, a1.index, b0.index) == (0, 1, 0), "two in-flight requests of one session share an index"
    assert a0.life == a1.life != b0.life and a0.previous is None
    rec.pop("a")
    assert rec.begin("a").index == 0, "a new life of the id restarts the count (a retried episode reseeds alike)"


def test_turn_of_a_request_in_flight_when_the_session_was_popped_is_dropped_and_counted():
    rec = SessionRecorder()
    ticket = rec.begin("s")
    assert rec.record("s", turn([1], [2]), ticket=ticket)
    late = rec.begin("s")
    out = rec.pop("s")  # the env worker gave up on the agent while `late` was in flight
    assert rec.record("s", turn([1, 2, 3], [4]), ticket=late) is False
    assert "s" not in rec and rec.stats["late_turns"] == 1 and rec.stats["live_sessions"] == 0
    assert out.num_turns == 1 and out.segments[0].input_ids == [1, 2]


def test_late_turn_does_not_join_the_next_life_of_the_same_id():
    rec = SessionRecorder()
    dead = rec.begin("s")
    rec.pop("s")  # the retry's pop at episode start
    retry = rec.begin("s")
    assert rec.record("s", turn([1], [2]), ticket=retry)
    assert rec.record("s", turn([1], [9]), ticket=dead) is False
    out = rec.pop("s")
    assert out.num_turns == 1 and [s.input_ids for s in out.segments] == [[1, 2]] and rec.stats["late_turns"] == 1


def test_a_new_attempt_discards_the_dead_attempts_turns_and_its_late_ones():
    rec = SessionRecorder()
    dead = rec.begin("s", "run-1")
    assert rec.record("s", turn([1], [2]), ticket=dead)
    in_flight = rec.begin("s", "run-1")  # the worker died with this request in flight
    retry = rec.begin("s", "run-2")  # Ray retried the episode: no pop came between
    assert retry.index == 0 and retry.previous is None, "the retry must not see the dead run's exchange"
    assert rec.record("s", turn([1, 2, 3], [4]), ticket=in_flight) is False
    assert rec.record("s", turn([1], [7]), ticket=retry)
    out = rec.pop("s", "run-2")
    assert [seg.input_ids for seg in out.segments] == [[1, 7]] and out.num_turns == 1
    assert rec.stats["superseded_sessions"] == 1 and rec.stats["late_turns"] == 1


def test_pop_of_an_attempt_that_made_no_request_returns_nothing_of_the_dead_one():
    rec = SessionRecorder()
    rec.record("s", turn([1], [2]), ticket=rec.begin("s", "run-1"))
    out = rec.pop("s", "run-2")  # the retry's agent failed before calling the model
    assert out.num_turns == 0 and out.segments == [] and "s" not in rec
    assert rec.stats["superseded_sessions"] == 1


def test_requests_of_one_attempt_share_the_session_and_no_attempt_means_any():
    rec = SessionRecorder()
    a, b = rec.begin("s", "run-1"), rec.begin("s", "run-1")
    assert (a.life, a.index, b.index) == (b.life, 0, 1)
    assert rec.begin("s").life == a.life, "a request without an attempt joins the live session"
    rec.record("s", turn([1], [2]), ticket=a)
    assert rec.pop("s", "run-1").num_turns == 1 and rec.stats["superseded_sessions"] == 0


def test_turn_in_flight_when_its_session_was_evicted_is_late():
    rec = SessionRecorder(max_sessions=1)
    ticket = rec.begin("a")
    rec.begin("b")  # evicts "a"
    assert rec.record("a", turn([1], [2]), ticket=ticket) is False
    assert "a" not in rec and rec.stats["late_turns"] == 1 and rec.stats["evicted_sessions"] == 1


def test_prompt_sources_are_counted_per_session_and_in_stats():
    rec = SessionRecorder()
    rec.record("s", turn([1], [2]), source="first")
    rec.record("s", turn([1, 2, 3], [4]), source="prompt_from_ids")
    rec.record("s", turn([1, 5], [6]), source="re_rendered", reason="history_changed")
    out = rec.pop("s")
    assert (out.prompt_from_ids, out.re_rendered, out.segment_breaks) == (1, 1, 1)
    stats = rec.stats
    assert stats["prompt_from_ids"] == 1 and stats["first"] == 1
    assert stats["re_rendered"] == 1 and stats["re_rendered_history_changed"] == 1
    assert stats["re_rendered_reply_changed"] == 0
