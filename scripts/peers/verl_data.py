"""rlsys's tic-tac-toe training boards as verl parquet files (issue 25, docs/peers.md; NOT yet run with verl on a GPU).

    python3 scripts/peers/verl_data.py --model /path/to/qwen-folder --out /tmp/peers/verl-data

Why the tool schema sits in the system message: verl's single-turn rollout renders `prompt` (chat messages) with the
model's chat template and no tools (verl's `tools` come from a tool registry and a multi-turn agent loop that
executes them). Qwen's template writes the tools into the system turn, so the system message here is that rendered
turn's text, and rendering these messages without tools gives the very prompt rlsys's proxy sends with
`tools=[CHOOSE_SQUARE_TOOL]`; `rows` checks it token for token and refuses a template where it does not hold.
The reward (scripts/peers/verl_reward.py) reads the board item back from `extra_info`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SYSTEM_OPEN, TURN_END = "<|im_start|>system\n", "<|im_end|>"


def messages_with_tools_in_system(tokenizer, board: str) -> list[dict]:
    """rlsys's messages for `board`, the system text replaced by the template's system turn rendered with the tool."""
    from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for

    messages = messages_for(board)
    text = tokenizer.apply_chat_template(messages, tools=[CHOOSE_SQUARE_TOOL], add_generation_prompt=True,
                                         tokenize=False)
    if not text.startswith(SYSTEM_OPEN):
        raise ValueError("the chat template does not open with a system turn: cannot fold the tools into it")
    system = text[len(SYSTEM_OPEN):text.index(TURN_END)]
    folded = [{"role": "system", "content": system}, *messages[1:]]
    expect = tokenizer.apply_chat_template(messages, tools=[CHOOSE_SQUARE_TOOL], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    got = tokenizer.apply_chat_template(folded, add_generation_prompt=True, tokenize=True, return_dict=False)
    if list(got) != list(expect):
        raise ValueError("folding the tools into the system message changes the prompt tokens for this template")
    return folded


def rows(tokenizer, items: list[dict], split: str) -> list[dict]:
    """verl's RLHFDataset rows: `prompt` messages, `data_source`, `reward_model`, `extra_info`."""
    return [{"data_source": "rlsys_tictactoe", "prompt": messages_with_tools_in_system(tokenizer, item["board"]),
             "ability": "tictactoe", "reward_model": {"style": "rule", "ground_truth": item["board"]},
             "extra_info": {"split": split, "index": i, "item": json.dumps(item)}}
            for i, item in enumerate(items)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "configs/tictactoe-qwen0.5b.toml"))
    args = p.parse_args(argv)

    import pandas as pd
    from transformers import AutoTokenizer

    from jobs.items import load_eval_items, load_items
    from rlsys.config import load_config

    cfg = load_config(args.config)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    train = load_items(cfg.data, cfg.algo.name, cfg.env.environment())
    held_out = load_eval_items(cfg.data, cfg.algo.name, cfg.env.environment())[:32]  # verl wants a val file
    for name, items in (("train", train), ("val", held_out)):
        pd.DataFrame(rows(tokenizer, items, name)).to_parquet(args.out / f"{name}.parquet")
    print(f"verl_data: {len(train)} train, {len(held_out)} val rows in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
