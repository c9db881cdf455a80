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
- Any other turn starts a new segment and counts a ``segment_break``. With prompts from ids (below)
  this happens only to prompts rendered in full: when the agent edits or truncates the history, or
  changes the system prompt or tools, and the template's render does not reproduce the sampled
  tokens (JSON spacing inside a tool call, BPE merges across a text/tag boundary), or when two
  requests of one session interleave. Training on re-rendered tokens with the sampled logprobs would
  be training on mismatched tokens, so rlsys never splices; it keeps both segments, each internally
  consistent.

Deliberate departure from "longest common prefix" splicing (DESIGN.md mentions it): we only extend
when the whole current segment is a prefix. A partial match would need the segment's tail (sampled
tokens) dropped or rewritten, which loses or misattributes logprobs.

Prompts from ids (continuation.py): when an agent sends back the assistant message as the proxy
returned it, the proxy builds the next prompt from the previous prompt and sampled ids, so the turn
extends the segment whatever the template would re-render. The recorder keeps each session's latest
``Exchange`` for that and counts, per session, ``prompt_from_ids`` and ``re_rendered`` turns (a later
turn rendered in full; ``stats`` also counts why).

Request tickets: the proxy calls ``begin`` when a request arrives and ``record`` with the ticket when
its completion is done. ``begin`` creates the session (a new *life* of that id) when it is not live and
hands out the request's index in the session (0, 1, 2, ... in arrival order, taken under the lock),
which seeds its sampling: two concurrent requests of one session never share a seed, and a sequential
agent gets the seeds it always got (one per turn). A ticket whose session life is gone by the time the
turn is recorded, because the env worker popped the session (an agent that timed out with a request in
flight) or it was evicted, is a *late turn*: dropped and counted (``late_turns``), so it cannot create
an orphan session or join the next life of the same id (a retried episode). The popped session is
freed at once; no list of closed ids is needed, the ticket carries its life.

Attempts: an env worker tags every request of one episode run with an attempt token (``X-Rlsys-Attempt``,
fresh per run). A request of a new attempt for a live session id ends the old attempt's life (a worker died
mid-episode and Ray retried the episode: the dead attempt's turns are discarded, its requests still in flight
become late turns, ``superseded_sessions`` counts it), and a pop that names an attempt returns only that
attempt's turns. So the retried episode never inherits the dead one's turns without a Ray call to the rollout
actor before every episode, the cost the agent path paid before (it delayed each episode's first request).

Bounded memory: at most ``max_sessions`` live sessions; a new session when the table is full evicts
the least recently used one (``evicted_sessions`` counts them; popping an evicted id gives an empty
record). A session keeps at most ``max_turns_per_session`` turns; later turns are not recorded and
counted in the record's ``dropped_turns`` (and in ``stats``), so a runaway agent loop cannot grow
memory without bound while the turns already recorded stay consistent.

Concurrency: all methods take one ``threading.Lock`` and never await, so they are safe to call from
the proxy's request handlers and from other actor methods on the same event loop (or threads).
"""
from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from rlsys.proxy.continuation import FALLBACK_REASONS, FIRST, FROM_IDS, RE_RENDERED, Exchange
from rlsys.types import Segment, Turn

# the headers an env worker's agent client sends with every turn, and the proxy reads (server.py `_parse`)
SESSION_HEADER = "X-Rlsys-Session"
ATTEMPT_HEADER = "X-Rlsys-Attempt"  # the env worker's run of the episode ("Attempts" above)


@dataclass
class SessionRecord:
    """What one session id produced: segments to train on and counters for metrics."""

    segments: list[Segment] = field(default_factory=list)
    num_turns: int = 0  # turns recorded (dropped turns not included)
    segment_breaks: int = 0  # recorded turns that did not extend the previous segment
    dropped_turns: int = 0  # turns over max_turns_per_session, not recorded
    prompt_from_ids: int = 0  # recorded turns whose prompt was built from the previous turn's ids
    re_rendered: int = 0  # recorded later turns whose prompt was a full chat-template render
    truncated_turns: int = 0  # recorded turns the engine cut at max_tokens (finish_reason "length")


@dataclass(frozen=True)
class RequestTicket:
    """A request's place in its session, taken when it arrives (``SessionRecorder.begin``)."""

    session_id: str
    life: int  # which life of the session id the request arrived in
    index: int  # 0, 1, 2, ... per session life in arrival order: the sampling seed's turn index
    previous: Exchange | None  # the session's latest exchange at arrival (None: the first request)


@dataclass
class _Session:
    record: SessionRecord
    life: int
    attempt: str | None = None  # the env worker's run of the episode that made this life
    requests: int = 0  # tickets handed out
    exchange: Exchange | None = None


class SessionRecorder:
    """Records turns per session id and folds them into prefix-extended ``Segment``s."""

    def __init__(self, max_sessions: int = 4096, max_turns_per_session: int = 256) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if max_turns_per_session < 1:
            raise ValueError(f"max_turns_per_session must be >= 1, got {max_turns_per_session}")
        self.max_sessions = max_sessions
        self.max_turns_per_session = max_turns_per_session
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._lives = itertools.count(1)
        self._lock = threading.Lock()
        self.evicted_sessions = 0
        self.dropped_turns = 0
        self.late_turns = 0
        self.superseded_sessions = 0
        self._prompt_sources: Counter[str] = Counter()  # FIRST, FROM_IDS, re_rendered_<reason>

    def begin(self, session_id: str, attempt: str | None = None) -> RequestTicket:
        """Register an arriving request: its index in the session and the session's latest exchange.
        A request of another ``attempt`` than the live session's starts a new life (the old one is discarded)."""
        with self._lock:
            session = self._live(session_id, attempt)
            ticket = RequestTicket(session_id, session.life, session.requests, session.exchange)
            session.requests += 1
            return ticket

    def record(self, session_id: str, turn: Turn, *, ticket: RequestTicket | None = None,
               source: str = "", reason: str = "", exchange: Exchange | None = None) -> bool:
        """Append ``turn`` to the session, extending its last segment when the prompt allows it.

        With a ``ticket`` (the proxy), a turn whose session life ended since ``begin`` is late: dropped,
        counted, and False returned. ``source``/``reason``: how the prompt was made (continuation.py);
        ``exchange`` becomes the session's latest, for the next request's prompt."""
        with self._lock:
            if ticket is None:
                session = self._live(session_id)
            else:
                session = self._sessions.get(session_id)
                if session is None or session.life != ticket.life:
                    self.late_turns += 1
                    return False
                self._sessions.move_to_end(session_id)
            if exchange is not None:
                session.exchange = exchange
            rec = session.record
            if rec.num_turns >= self.max_turns_per_session:
                rec.dropped_turns += 1
                self.dropped_turns += 1
                return False
            rec.num_turns += 1
            if source:
                self._prompt_sources[source if source != RE_RENDERED else f"{RE_RENDERED}_{reason}"] += 1
            rec.prompt_from_ids += source == FROM_IDS
            rec.re_rendered += source == RE_RENDERED
            rec.truncated_turns += turn.finish_reason == "length"
            if rec.segments and _extends(turn.prompt_ids, rec.segments[-1].input_ids):
                _append_turn(rec.segments[-1], turn)
                return True
            if rec.segments:
                rec.segment_breaks += 1
            rec.segments.append(_new_segment(turn))
            return True

    def pop(self, session_id: str, attempt: str | None = None) -> SessionRecord:
        """Remove and return the session's record; an unknown (or evicted) id gives an empty one, and so does
        a live session of another ``attempt`` than the one named (discarded: a dead run's turns).
        The session's life ends: turns of requests still in flight are late (dropped, counted)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None and attempt is not None and session.attempt != attempt:
                self.superseded_sessions += 1
                session = None
        return session.record if session is not None else SessionRecord()

    def num_turns(self, session_id: str) -> int:
        """Turns recorded so far under ``session_id`` (0 for an unknown id)."""
        with self._lock:
            session = self._sessions.get(session_id)
            return session.record.num_turns if session is not None else 0

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._sessions

    @property
    def stats(self) -> dict[str, int]:
        """Counters for metrics (cumulative): live sessions, sessions evicted, turns dropped (over the
        per-session cap), late turns (session popped or evicted in flight), and how recorded prompts
        were made: ``prompt_from_ids``, ``first``, ``re_rendered_<reason>`` per fallback reason."""
        with self._lock:
            sources = {FROM_IDS: 0, FIRST: 0, **{f"{RE_RENDERED}_{r}": 0 for r in FALLBACK_REASONS}}
            sources.update(self._prompt_sources)
            return {
                "live_sessions": len(self._sessions),
                "evicted_sessions": self.evicted_sessions,
                "dropped_turns": self.dropped_turns,
                "late_turns": self.late_turns,
                "superseded_sessions": self.superseded_sessions,
                RE_RENDERED: sum(v for k, v in sources.items() if k.startswith(RE_RENDERED)),
                **sources,
            }

    def _live(self, session_id: str, attempt: str | None = None) -> _Session:
        """The session's current life, made (evicting the least recently used) when there is none or it
        belongs to another attempt."""
        session = self._sessions.get(session_id)
        if session is not None and (attempt is None or session.attempt == attempt):
            self._sessions.move_to_end(session_id)
            return session
        if session is not None:  # a dead run's session: its turns go, its requests in flight become late
            del self._sessions[session_id]
            self.superseded_sessions += 1
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
            self.evicted_sessions += 1
        session = self._sessions[session_id] = _Session(SessionRecord(), next(self._lives), attempt)
        return session


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
