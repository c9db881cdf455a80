"""Ledger SFT chats, a protocol warm start: `python -m rlsys.envs.ledger.sft_data --out FILE`.

Why: a random tiny model never writes a tool call, so every episode is one turn and RL has nothing to
compare. These chats teach the PROTOCOL only (call syntax for the three tools, reading tool results,
several turns, ending with a text answer), not the task: after listing and reading, the assistant moves
1 to 3 RANDOM tickets one legal step each, so most chats would score collateral or unsolved. Choosing
the right tickets is left to RL.
"""
from __future__ import annotations

import json
import random

from rlsys.envs.datasets import sft_main
from rlsys.envs.ledger.dataset import make_dataset
from rlsys.envs.ledger.episode import Episode
from rlsys.envs.ledger.ledger import TRANSITIONS
from rlsys.envs.ledger.prompt import TOOLS, first_messages
from rlsys.envs.tictactoe_game.turns import assistant_echo, tool_message


def sft_chat(item: dict, rng: random.Random) -> dict:
    ep = Episode.start(item)
    messages = first_messages(item)
    ids = [t["id"] for t in item["tickets"]]
    plan = [("list_tickets", {})] + [("read_ticket", {"id": rng.choice(ids)})]
    for tid in rng.sample(ids, rng.randint(1, 3)):
        plan.append(("update_ticket", {"id": tid}))
    for n, (name, args) in enumerate(plan):
        if name == "update_ticket":  # a legal next step of the ticket as it is now
            options = TRANSITIONS[ep.ledger.tickets[args["id"]]["status"]]
            if not options:
                continue
            args = {**args, "status": rng.choice(options)}
        turn = {"content": None, "tool_calls": [{"id": f"call_{n}", "name": name, "arguments": json.dumps(args)}]}
        results = ep.play_turn(turn)
        messages += [assistant_echo(turn)] + [tool_message(i, text) for i, text in results]
    messages.append({"role": "assistant", "content": "Done."})
    return {"id": f"sft-{item['id']}", "messages": messages, "tools": TOOLS}


def make_sft_dataset(count: int, seed: int) -> list[dict]:
    rng = random.Random(f"ledger/sft/{seed}")
    return [sft_chat(item, rng) for item in make_dataset(count, seed, "train")]


def main(argv: list[str] | None = None) -> int:
    return sft_main(argv, "python -m rlsys.envs.ledger.sft_data", __doc__.splitlines()[0], make_sft_dataset, 256,
                    "ledger chats")


if __name__ == "__main__":
    raise SystemExit(main())
