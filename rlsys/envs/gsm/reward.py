"""The math word problem reward plug-in: the outcome, recomputed by replaying the model's turns.

record = {"item": <item>, "output": {"turns": [turn records], ...}} (agent.py). The reward replays the turns
on the item (episode.replay; with `prompt_variant` set, on the perturbed item the agent saw) and reads nothing
else the agent reports: an output that claims an answer it did not call scores what was called.

    right             1.0   answer(value) within a relative 1e-6 of the item's answer
    wrong             0.0   answer(value) with another number
    no_answer        -1.0   a turn without a tool call (or turns that stop early, e.g. a full context)
    malformed_call   -1.0   a broken call, another tool, bad arguments, answer with something not a number
    calculator_error -1.0   no answer, and some calculate call came back as an error
    too_many_turns   -1.0   MAX_TURNS turns of calculations and no answer

A malformed output is a -1.0 sample, not an exception (the behaviour RL must punish). A bad item, or turns
after the episode ended, raise: bad data or an agent bug (the trajectory is marked failed and counted).
`summarize(outcomes)` gives the rates; given the records too, also the calculator use (`calculator_stats`);
`episode_metrics(record)` is one episode's calculator use as scalars.
"""
from __future__ import annotations

from rlsys.envs.gsm.dataset import validate_item
from rlsys.envs.gsm.episode import Episode, replay
from rlsys.envs.gsm.perturb import PERTURBATIONS, effective_item

__all__ = ["OUTCOMES", "PERTURBATIONS", "calculator_stats", "episode_metrics", "judge", "outcome", "reward",
           "summarize", "validate_item"]

OUTCOMES = ("right", "wrong", "no_answer", "malformed_call", "calculator_error", "too_many_turns")
REWARD_BY_OUTCOME = {"right": 1.0, "wrong": 0.0, "no_answer": -1.0, "malformed_call": -1.0,
                     "calculator_error": -1.0, "too_many_turns": -1.0}


def judge(record: dict) -> Episode:
    item = record["item"]
    validate_item(item)
    output = record.get("output")
    turns = output.get("turns") if isinstance(output, dict) else None
    return replay(effective_item(item), turns if isinstance(turns, list) else [])


def outcome(record: dict) -> str:
    return judge(record).label


def reward(record: dict) -> float:
    return REWARD_BY_OUTCOME[outcome(record)]


def episode_metrics(record: dict) -> dict[str, float]:
    """One episode's calculator use as scalars (what an env worker can attach to the trajectory's summary, so the
    driver can average them without pulling trajectories): calls, calls that came back as an error, 1.0 if
    the episode called the calculator at all, and 1.0 if it did and was right (averaged: the share of episodes
    right with the calculator, so that right | used = right_with_calculator / used_calculator, and right | not used
    = (error/right - right_with_calculator) / (1 - used_calculator): whether the tool helps the policy)."""
    episode = judge(record)
    calls = episode.calculations
    return {"calculator_calls": float(len(calls)), "calculator_errors": float(sum(not c["ok"] for c in calls)),
            "used_calculator": float(bool(calls)),
            "right_with_calculator": float(bool(calls) and episode.label == "right")}


def calculator_stats(records: list[dict]) -> dict[str, float]:
    """Calculator use over episodes (records as the reward gets them): the share of episodes with at least one
    calculate call, calls per episode, and the share of calls that came back as an error."""
    episodes = [judge(r) for r in records]
    calls = [c for ep in episodes for c in ep.calculations]
    n = max(len(episodes), 1)
    return {
        "calculator_use_rate": sum(bool(ep.calculations) for ep in episodes) / n,
        "calculator_calls_mean": len(calls) / n,
        "calculator_error_rate": sum(not c["ok"] for c in calls) / max(len(calls), 1),
    }


def summarize(outcomes: list[str], records: list[dict] | None = None) -> dict[str, float]:
    """Evaluation rates from outcome labels ("failed" episodes count as misses); with the episodes' records
    (same order), the calculator use as well (`calculator_stats`)."""
    n = max(len(outcomes), 1)
    out = {
        "right_rate": sum(o == "right" for o in outcomes) / n,
        "answered_rate": sum(o in ("right", "wrong") for o in outcomes) / n,
        "malformed_call_rate": sum(o == "malformed_call" for o in outcomes) / n,
    }
    if records is not None:
        out.update(calculator_stats(records))
    return out
