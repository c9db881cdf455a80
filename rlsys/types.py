"""Typed records that cross process boundaries (proxy -> env worker -> learner, learner -> engine).

Plain dataclasses of Python lists and scalars, so they pickle cheaply through the Ray object store
and are testable without Ray. Lengths are checked in ``__post_init__`` (SkyRL's ``WeightChunk`` habit):
a record that lies about its shape fails where it is made, not three processes later.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Turn:
    """One chat completion as the engine produced it, recorded server-side by the proxy."""

    prompt_ids: list[int]  # (P,) the token ids the engine was given (chat template applied)
    completion_ids: list[int]  # (C,) the token ids the engine sampled
    logprobs: list[float]  # (C,) the engine's log-probability of each sampled token
    finish_reason: str = "stop"  # the engine's: "stop" (an eos or stop id) | "length" (cut at max_tokens)

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"Turn: {len(self.logprobs)} logprobs for {len(self.completion_ids)} completion ids"
            )


@dataclass
class Segment:
    """A single token sequence built from one or more turns that extend each other's prefix.

    Multi-turn sessions append a turn to the current segment when its prompt extends the segment's
    tokens; otherwise (re-tokenisation drift, an edited history) a new segment starts.
    """

    input_ids: list[int]  # (T,) prompt + every sampled token + tool results in between
    loss_mask: list[int]  # (T,) 1 exactly on tokens the engine sampled, 0 elsewhere
    rollout_logprobs: list[float]  # (T,) engine logprob on sampled tokens, 0.0 elsewhere
    # (T,) the frozen KL reference's logprob of each token given those before it (0.0 at position 0), filled in
    # between rollout and learner by the reference actor (`learner.reference_actor`); None: the learner runs it
    ref_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"Segment: input_ids {n}, loss_mask {len(self.loss_mask)}, "
                f"rollout_logprobs {len(self.rollout_logprobs)} must be equal"
            )
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"Segment: input_ids {n}, ref_logprobs {len(self.ref_logprobs)} must be equal")

    @property
    def num_sampled(self) -> int:
        return int(sum(self.loss_mask))


@dataclass
class Trajectory:
    """One agent episode on one dataset item: what the learner trains on and the driver counts.

    ``failed`` trajectories (agent or reward raised, hung or returned garbage) carry a reason, are
    counted in metrics and excluded from group statistics and from the loss; they are never scored 0.
    """

    item_id: str
    group: int  # index of the item in the step's batch: advantages are normalised per group
    sample: int  # index of the sample within its group
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    outcome: str = ""  # label for the error table, e.g. "optimal", "occupied", "no_tool_call"
    failed: bool = False
    fail_reason: str = ""  # e.g. "agent_timeout", "reward_error: ValueError: ..."
    num_turns: int = 0
    segment_breaks: int = 0  # turns that did not extend the previous prefix and started a segment
    info: dict[str, Any] = field(default_factory=dict)
    prompt_from_ids: int = 0  # turns whose prompt the proxy built from the previous turn's token ids
    re_rendered: int = 0  # later turns whose prompt was a full chat-template render (history not echoed)
    truncated_turns: int = 0  # turns cut at max_tokens: the answer never ended (`algo.mask_truncated`)
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's `episode_metrics` (scalars)

    @property
    def response_len(self) -> int:
        return sum(s.num_sampled for s in self.segments)


@dataclass
class TrajectorySummary:
    """What the driver sees of a trajectory: scalars only, so it never pulls token lists."""

    item_id: str
    group: int
    sample: int
    reward: float
    outcome: str
    failed: bool
    fail_reason: str
    response_len: int
    num_turns: int
    segment_breaks: int
    prompt_from_ids: int = 0
    re_rendered: int = 0
    truncated_turns: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # a few scalars per episode (`episode_metrics`)

    @classmethod
    def of(cls, t: Trajectory) -> "TrajectorySummary":
        """Every field from the trajectory's attribute of the same name (`response_len`: its property)."""
        return cls(**{f.name: getattr(t, f.name) for f in fields(cls)})
