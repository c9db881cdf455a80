"""What the seeded multi-turn environments' dataset modules share (rlsys/envs/ledger, rlsys/envs/tictactoe_game):
a train and a held-out split drawn from one seeded generator, the item's keys checked first, JSONL out, the
`python -m ... --count --seed --split --out` command that writes the shipped files, and the command that writes
their SFT chats (`sft_main`).

Each module keeps its own `make_item(index, rng, split)`, `validate_item` and item keys; the same (count, seed, split)
gives the same bytes as before these were shared (the generator's seed string is the module's own).
"""
from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

SPLITS = ("train", "heldout")


def seeded_items(make_item: Callable[[int, random.Random, str], dict], name: str, count: int, seed: int,
                 split: str) -> list[dict]:
    """``count`` items of ``split`` from one generator seeded by ``name/split/seed``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    rng = random.Random(f"{name}/{split}/{seed}")
    return [make_item(i, rng, split) for i in range(count)]


def check_item_keys(item: object, keys: tuple[str, ...]) -> None:
    """Raise ValueError unless ``item`` is a JSON object with every key of ``keys``."""
    if not isinstance(item, dict):
        raise ValueError(f"item must be a JSON object, got {type(item).__name__}")
    missing = [k for k in keys if k not in item]
    if missing:
        raise ValueError(f"item {item.get('id')!r}: missing key(s) {missing}")


def jsonl_lines(items: list[dict], keys: tuple[str, ...]) -> str:
    """One JSON line per item, its ``keys`` only, in that order."""
    return "".join(json.dumps({k: item[k] for k in keys}) + "\n" for item in items)


def write_main(argv: list[str] | None, prog: str, description: str,
               make_dataset: Callable[[int, int, str], list[dict]], keys: tuple[str, ...], what: str) -> int:
    """`python -m <prog> --count N --seed S [--split train|heldout] --out FILE`: write the items as JSONL."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(jsonl_lines(make_dataset(args.count, args.seed, args.split), keys), encoding="utf-8")
    print(f"wrote {args.count} {args.split} {what} to {args.out}")
    return 0


def sft_main(argv: list[str] | None, prog: str, description: str, make_sft_dataset: Callable[[int, int], list[dict]],
             default_count: int, what: str) -> int:
    """`python -m <prog> [--count N] [--seed S] --out FILE`: write ``make_sft_dataset(count, seed)``'s chats as JSONL."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--count", type=int, default=default_count)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    chats = make_sft_dataset(args.count, args.seed)
    args.out.write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    print(f"wrote {len(chats)} {what} to {args.out}")
    return 0
