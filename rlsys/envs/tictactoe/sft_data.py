"""Synthetic SFT chats for the tic-tac-toe format warm start: `python -m rlsys.envs.tictactoe.sft_data`.

The data teaches the FORMAT only: the assistant answers every board with one `choose_square` call whose
square is drawn uniformly from 1..9, occupied squares included, so legality and strategy are left to RL
(a warm start that already played well would make the RL curve meaningless).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, TOOL_NAME, messages_for


def sft_item(item: dict, square: int) -> dict:
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": json.dumps({"square": square})}}
    messages = messages_for(item["board"]) + [{"role": "assistant", "content": "", "tool_calls": [call]}]
    return {"id": f"sft-{item['id']}-{square}", "messages": messages, "tools": [CHOOSE_SQUARE_TOOL]}


def make_sft_dataset(items: list[dict], count: int, seed: int) -> list[dict]:
    """``count`` chats over the given boards, squares uniform in 1..9 (ids unique per board+square)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < count:
        item = items[rng.randrange(len(items))]
        square = rng.randint(1, 9)
        chat = sft_item(item, square)
        if chat["id"] in seen and len(seen) < len(items) * 9:
            continue
        seen.add(chat["id"])
        out.append(chat)
    return out


def main(argv: list[str] | None = None) -> int:
    from rlsys.envs.tictactoe.dataset import make_dataset

    p = argparse.ArgumentParser(prog="python -m rlsys.envs.tictactoe.sft_data", description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=2048)
    p.add_argument("--boards", type=int, default=2048, help="training boards drawn from (dataset seed --board-seed)")
    p.add_argument("--board-seed", type=int, default=2026)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    chats = make_sft_dataset(make_dataset(args.boards, args.board_seed), args.count, args.seed)
    Path(args.out).write_text("".join(json.dumps(c) + "\n" for c in chats))
    print(f"wrote {len(chats)} chats to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
