"""The tic-tac-toe reward plug-in: `reward(record) -> float` and `outcome(record) -> str`.

record = {"item": <dataset item>, "output": <agent output>} (docs/CONTRACTS.md), where the agent
output is {"content": str | None, "tool_calls": [{"name": str, "arguments": str}], "finish_reason": str}.

Rules (the design's reward table), deciding on the FIRST tool call only:
    no tool call                                   -1.0  'no_tool_call'
      ... but the content holds a broken or unextracted tool-call attempt
                                                   -1.0  'parse_error'
    wrong tool name, arguments not JSON text of an object with exactly the key 'square',
    or 'square' not a JSON integer (true, 5.0 and "5" are not integers: the schema says integer)
                                                   -1.0  'parse_error'
    integer outside 1..9                           -1.0  'out_of_range'
    occupied square                                -1.0  'occupied'
    immediate win                                   1.0  'win'
    minimax-optimal move                            0.8  'optimal'
    legal, not optimal                              0.0  'legal_suboptimal'

Why so defensive: the output is whatever a policy under training produced, so any field may have
any type. A malformed output is a -1.0 sample, never an exception (an exception would mark the
trajectory failed and drop it from the group baseline, hiding exactly the behaviour RL must punish).
Only a bad `record['item']` raises: that is bad data or a framework bug, not the model's fault.

`summarize(outcomes)` and `summarize_by_kind(items, outcomes)` are the optional evaluation hooks jobs/eval.py
calls: the held-out rates over all boards, and split by what a board tests (`game.board_kind`);
`episode_metrics(record)` is the same split for the training batches, one episode at a time.
"""
from __future__ import annotations

import json

from rlsys.envs.tictactoe import game
from rlsys.envs.tictactoe.dataset import validate_item
from rlsys.envs.tictactoe.prompt import TOOL_NAME
from rlsys.proxy.toolcalls import parse_tool_calls

# the error-table labels, always logged (as 0.0 when absent) so every curve starts at step 0
OUTCOMES = game.OUTCOMES

MALFORMED_REWARD = -1.0


def _label_without_tool_calls(content: object) -> str:
    """'parse_error' if `content` holds a tool-call attempt the proxy did not deliver, else 'no_tool_call'."""
    if not isinstance(content, str):
        return "no_tool_call"
    parsed = parse_tool_calls(content, tool_names={TOOL_NAME})
    return "parse_error" if parsed.errors or parsed.calls else "no_tool_call"


def _square_from_arguments(arguments: object) -> int | None:
    """The 'square' integer if `arguments` is JSON text of exactly {"square": <int>}, else None."""
    if not isinstance(arguments, str):
        return None
    try:
        decoded = json.loads(arguments)
    except (ValueError, RecursionError):  # bad JSON (incl. huge ints), or nesting too deep to decode
        return None
    if not isinstance(decoded, dict) or set(decoded) != {"square"}:
        return None
    square = decoded["square"]
    if type(square) is not int:  # rejects bool (a subclass of int), float and str
        return None
    return square


def _first_call_square(output: object) -> int | str:
    """The square of the first tool call, or the label ('no_tool_call' / 'parse_error') explaining why none."""
    if output is None:
        return "no_tool_call"
    if not isinstance(output, dict):
        return "parse_error"
    tool_calls = output.get("tool_calls")
    if tool_calls is None or tool_calls == []:
        return _label_without_tool_calls(output.get("content"))
    if not isinstance(tool_calls, list):
        return "parse_error"
    first_call = tool_calls[0]
    if not isinstance(first_call, dict) or first_call.get("name") != TOOL_NAME:
        return "parse_error"
    square = _square_from_arguments(first_call.get("arguments"))
    return "parse_error" if square is None else square


def _checked_board(record: object) -> str:
    """record['item']['board'], after checking the item; raises ValueError naming it as a data/framework bug."""
    if not isinstance(record, dict) or "item" not in record:
        raise ValueError(
            f"reward record must be a dict with an 'item' key (framework bug), got {type(record).__name__}"
        )
    try:
        validate_item(record["item"])
    except ValueError as error:
        raise ValueError(f"reward record has an invalid dataset item (bad data or framework bug): {error}") from error
    return record["item"]["board"]


def _board_and_move(record: dict) -> tuple[str, int | str]:
    """The record's checked board, and its first call's square or the label of why there is none."""
    return _checked_board(record), _first_call_square(record.get("output"))


def outcome(record: dict) -> str:
    """The error-table label of `record` (one of game.OUTCOMES)."""
    return _label(*_board_and_move(record))


def _label(board: str, square_or_label: int | str) -> str:
    """The error-table label of a checked board and its first call's square (or the label of why there is none)."""
    return square_or_label if isinstance(square_or_label, str) else game.move_outcome(board, square_or_label)


def reward(record: dict) -> float:
    """The scalar reward of `record`: -1.0 for any malformed or illegal move, else game.score_move."""
    board, square_or_label = _board_and_move(record)
    return MALFORMED_REWARD if isinstance(square_or_label, str) else game.score_move(board, square_or_label)


def summarize(outcomes: list[str]) -> dict[str, float]:
    """Evaluation rates from error-table labels: valid tool call, legal move, optimal move, winning move."""
    n = max(len(outcomes), 1)
    valid = sum(o not in ("no_tool_call", "parse_error") for o in outcomes)
    legal = sum(o in ("legal_suboptimal", "optimal", "win") for o in outcomes)
    optimal = sum(o in ("optimal", "win") for o in outcomes)
    return {"valid_call_rate": valid / n, "legal_move_rate": legal / n, "optimal_move_rate": optimal / n,
            "win_move_rate": sum(o == "win" for o in outcomes) / n}


# per board kind: the rates reported, each with the outcomes it counts there (the first rate is the kind's success)
KIND_RATES = {
    "win": (("win_taken_rate", ("win",)),  # an immediate win exists: was it taken?
            ("win_later_rate", ("optimal",))),  # or a move that still forces a win later (0.8): a miss, counted apart
    "block": (("block_rate", ("optimal", "win")),),  # O threatens, X has no win: the only non-losing move is the block
    "lost": (("lost_legal_rate", ("legal_suboptimal", "optimal", "win")),),  # every legal move is optimal
    "other": (("other_optimal_rate", ("optimal", "win")),),
}


def episode_metrics(record: dict) -> dict[str, float]:
    """The `summarize_by_kind` rates this episode's board tests, each 0.0 or 1.0, named without `_rate`:
    `win_taken` and `win_later` on a board with an immediate win, else `block`, `lost_legal` or `other_optimal`.
    Averaged over a training step's episodes that report them (`Environment.episode_metrics`), they are the sampled
    policy's rates by kind of board during training (`episode/win_taken`, ...), beside the held-out eval's
    `win_taken_rate`, ...: where a run stops improving on wins or blocks shows as it trains, not only at the end.
    (Without `_rate` an evaluation's copy, `eval/episode/win_taken`, is not printed again as if `episode` were a
    prompt variant.)"""
    board, square_or_label = _board_and_move(record)  # the item checked once
    label = _label(board, square_or_label)
    return {name.removesuffix("_rate"): float(label in counted) for name, counted in KIND_RATES[game.board_kind(board)]}


def summarize_by_kind(items: list[dict], outcomes: list[str]) -> dict[str, float]:
    """Evaluation rates split by board kind (`game.board_kind`), one outcome per item (a failed episode's outcome
    is any other label and counts as a miss): `win_taken_rate`, `block_rate` (exactly the optimal rate on those
    boards), `lost_legal_rate`, `other_optimal_rate`, and `<kind>_episodes`. A kind without episodes gets no rate.
    Beside `win_taken_rate`, `win_later_rate`: the share of the boards with an immediate win where the answer was a
    move that still forces a win later (`optimal`, 0.8), so that the missed wins split into slower wins and worse
    moves (1 - taken - later)."""
    if len(items) != len(outcomes):
        raise ValueError(f"summarize_by_kind: {len(items)} items but {len(outcomes)} outcomes")
    hits = {name: 0 for rates in KIND_RATES.values() for name, _ in rates}
    episodes = dict.fromkeys(game.BOARD_KINDS, 0)
    for item, label in zip(items, outcomes):
        kind = game.board_kind(item["board"])
        episodes[kind] += 1
        for name, counted in KIND_RATES[kind]:
            hits[name] += label in counted
    out: dict[str, float] = {}
    for kind in game.BOARD_KINDS:
        if episodes[kind]:
            out.update({name: hits[name] / episodes[kind] for name, _ in KIND_RATES[kind]})
        out[f"{kind}_episodes"] = float(episodes[kind])
    return out
