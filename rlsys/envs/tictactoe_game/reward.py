"""The whole-game reward plug-in: the game's result, recomputed by replaying the model's turns.

record = {"item": <game item>, "output": {"turns": [turn records], ...}} (agent.py). The reward
replays the turns with episode.Game against the item's deterministic opponent; the agent's own
"outcome" and "final_board" are ignored, so an output that claims a win it did not play scores
what was played.

    win                                    1.0
    draw                                   0.5   (the best X can force against a perfect opponent)
    loss                                  -0.5   (a legal game lost is better than a forfeit)
    forfeit: no_tool_call, parse_error, multiple_calls, out_of_range, occupied
                                          -1.0   (ends the game at that turn)
    unfinished: the turns stop before the game is over (an agent cut short) -1.0

A malformed output is a -1.0 sample, not an exception (the behaviour RL must punish). A bad item, or
turns that go on after the game ended, raise: bad data or an agent bug, not the model's fault (the
trajectory is marked failed and counted).
"""
from __future__ import annotations

from rlsys.envs.tictactoe_game.dataset import validate_item
from rlsys.envs.tictactoe_game.episode import FORFEITS, RESULTS, replay

OUTCOMES = (*RESULTS, *FORFEITS, "unfinished")
REWARD_BY_OUTCOME = {"win": 1.0, "draw": 0.5, "loss": -0.5, **{f: -1.0 for f in FORFEITS}, "unfinished": -1.0}


def _turns(record: dict) -> list:
    output = record.get("output")
    turns = output.get("turns") if isinstance(output, dict) else None
    return turns if isinstance(turns, list) else []


def outcome(record: dict) -> str:
    item = record["item"]
    validate_item(item)
    return replay(item, _turns(record)).outcome or "unfinished"


def reward(record: dict) -> float:
    return REWARD_BY_OUTCOME[outcome(record)]


def summarize(outcomes: list[str]) -> dict[str, float]:
    """Evaluation rates from outcome labels."""
    n = max(len(outcomes), 1)
    return {
        "win_rate": sum(o == "win" for o in outcomes) / n,
        "draw_rate": sum(o == "draw" for o in outcomes) / n,
        "loss_rate": sum(o == "loss" for o in outcomes) / n,
        "finished_game_rate": sum(o in RESULTS for o in outcomes) / n,
    }
