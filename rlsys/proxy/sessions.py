"""Server-side recording of agent sessions as trainable token segments.

The proxy records every chat completion made under a session id (the ``X-Rlsys-Session`` header)
as a ``Turn`` (the exact prompt ids given to the engine, the sampled ids and their logprobs). When
the agent's episode ends, the env worker pops the session and gets ``Segment``s: the learner trains
on the tokens the engine actually sampled, never on re-tokenised text.

How turns become segments (prefix extension):

- The first turn starts a segment: prompt ids (loss mask 0, logprob 0.0) followed by the completion
  ids (mask 1, the engine's logprobs).
- A later turn whose ``prompt_ids`` start with the current (last) segment's full ``input_ids``
  extends it: the new prompt suffix (tool results, user text, the template's turn markers) is
  appended with mask 0, then the completion with mask 1.
- Any other turn starts a new segment and counts a ``segment_break``. This happens when the chat
  template re-renders the previous assistant message differently from what was sampled (JSON
  spacing inside a tool call, BPE merges across a text/tag boundary), when the agent edits or
  truncates the history, or when two requests of one session interleave. Training on the
  re-rendered tokens with the sampled logprobs would be training on mismatched tokens, so rlsys
  never splices; it keeps both segments, each internally consistent.

Deliberate departure from "longest common prefix" splicing (DESIGN.md mentions it): we only extend
when the whole current segment is a prefix. A partial match would need the segment's tail (sampled
tokens) dropped or rewritten, which loses or misattributes logprobs.

Bounded memory: at most ``max_sessions`` live sessions; recording under a new id when the table is
full evicts the least recently used session (``evicted_sessions`` counts them; popping an evicted id
gives an empty record). A session keeps at most ``max_turns_per_session`` turns; later turns are not
recorded and counted in the record's ``dropped_turns`` (and in ``stats``), so a runaway agent loop
cannot grow memory without bound while the turns already recorded stay consistent.

Concurrency: all methods take one ``threading.Lock`` and never await, so they are safe to call from
the proxy's request handlers and from other actor methods on the same event loop (or threads).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from rlsys.types import Segment, Turn


@dataclass
class SessionRecord:
    """What one session id produced: segments to train on and counters for metrics."""

    segments: list[Segment] = field(default_factory=list)
    num_turns: int = 0  # turns recorded (dropped turns not included)
    segment_breaks: int = 0  # recorded turns that did not extend the previous segment
    dropped_turns: int = 0  # turns over max_turns_per_session, not recorded


class SessionRecorder:
    """Records turns per session id and folds them into prefix-extended ``Segment``s."""

    def __init__(self, max_sessions: int = 4096, max_turns_per_session: int = 256) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if max_turns_per_session < 1:
            raise ValueError(f"max_turns_per_session must be >= 1, got {max_turns_per_session}")
        self.max_sessions = max_sessions
        self.max_turns_per_session = max_turns_per_session
        self._sessions: OrderedDict[str, SessionRecord] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.evicted_sessions = 0
        self.dropped_turns = 0

    def record(self, session_id: str, turn: Turn) -> None:
        """Append ``turn`` to the session, extending its last segment when the prompt allows it."""
        with self._lock:
            rec = self._sessions.get(session_id)
            if rec is None:
                while len(self._sessions) >= self.max_sessions:
                    self._sessions.popitem(last=False)
                    self.evicted_sessions += 1
                rec = self._sessions[session_id] = SessionRecord()
            else:
                self._sessions.move_to_end(session_id)
            if rec.num_turns >= self.max_turns_per_session:
                rec.dropped_turns += 1
                self.dropped_turns += 1
                return
            rec.num_turns += 1
            if rec.segments and _extends(turn.prompt_ids, rec.segments[-1].input_ids):
                _append_turn(rec.segments[-1], turn)
                return
            if rec.segments:
                rec.segment_breaks += 1
            rec.segments.append(_new_segment(turn))

    def pop(self, session_id: str) -> SessionRecord:
        """Remove and return the session's record; an unknown (or evicted) id gives an empty one."""
        with self._lock:
            rec = self._sessions.pop(session_id, None)
        return rec if rec is not None else SessionRecord()

    def num_turns(self, session_id: str) -> int:
        """Turns recorded so far under ``session_id`` (0 for an unknown id)."""
        with self._lock:
            rec = self._sessions.get(session_id)
            return rec.num_turns if rec is not None else 0

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._sessions

    @property
    def stats(self) -> dict[str, int]:
        """Counters for metrics: live sessions, sessions evicted, turns dropped (cumulative)."""
        with self._lock:
            return {
                "live_sessions": len(self._sessions),
                "evicted_sessions": self.evicted_sessions,
                "dropped_turns": self.dropped_turns,
            }


def _extends(prompt_ids: list[int], prefix: list[int]) -> bool:
    # A prompt equal to the segment (no new prompt tokens) still extends it.
    return len(prompt_ids) >= len(prefix) and prompt_ids[: len(prefix)] == prefix


def _new_segment(turn: Turn) -> Segment:
    p, c = len(turn.prompt_ids), len(turn.completion_ids)
    return Segment(
        input_ids=list(turn.prompt_ids) + list(turn.completion_ids),
        loss_mask=[0] * p + [1] * c,
        rollout_logprobs=[0.0] * p + [float(x) for x in turn.logprobs],
    )


def _append_turn(seg: Segment, turn: Turn) -> None:
    suffix = turn.prompt_ids[len(seg.input_ids) :]
    c = len(turn.completion_ids)
    seg.input_ids.extend(suffix)
    seg.input_ids.extend(turn.completion_ids)
    seg.loss_mask.extend([0] * len(suffix) + [1] * c)
    seg.rollout_logprobs.extend([0.0] * len(suffix) + [float(x) for x in turn.logprobs])
