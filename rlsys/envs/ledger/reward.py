"""The ledger reward plug-in: the verdict, recomputed from the item and the model's turns.

record = {"item": <ledger item>, "output": {"turns": [turn records], ...}} (agent.py). The reward
replays every turn's tool calls on a fresh ledger built from the item (episode.replay) and judges
the final state with episode.verdict (the table is in episode.py). What the agent reports
("actions", "end", "final_statuses") and whatever the model says ("done, all resolved") are not
read: a claimed success without the updates scores as unsolved, an edit outside the task as collateral.
A malformed output is a -1.0 sample (no turns: no tool call); a bad item, or turns after the
episode ended, raise (bad data or an agent bug: the trajectory is marked failed and counted).
"""
from __future__ import annotations

from rlsys.envs.ledger.dataset import validate_item
from rlsys.envs.ledger.episode import OUTCOMES, Verdict, replay, verdict

__all__ = ["OUTCOMES", "judge", "outcome", "reward", "summarize"]


def judge(record: dict) -> Verdict:
    item = record["item"]
    validate_item(item)
    output = record.get("output")
    turns = output.get("turns") if isinstance(output, dict) else None
    return verdict(replay(item, turns if isinstance(turns, list) else []))


def reward(record: dict) -> float:
    return judge(record).reward


def outcome(record: dict) -> str:
    return judge(record).outcome


def summarize(outcomes: list[str]) -> dict[str, float]:
    """Evaluation rates from outcome labels."""
    n = max(len(outcomes), 1)
    return {
        "solved_rate": sum(o in ("solved", "solved_with_refusals") for o in outcomes) / n,
        "clean_solve_rate": sum(o == "solved" for o in outcomes) / n,
        "collateral_rate": sum(o == "collateral" for o in outcomes) / n,
        "protocol_error_rate": sum(o in ("no_tool_call", "broken_call") for o in outcomes) / n,
    }
