"""scripts/peers/verl_data.py and verl_reward.py: the verl peer must prompt and score exactly as rlsys does (issue 25).

verl itself is not installed here; these check the adapters with rlsys's tiny model (a Qwen-style chat template).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rlsys.envs.tictactoe.dataset import make_dataset
from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / f"scripts/peers/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


verl_data, verl_reward = _load("verl_data"), _load("verl_reward")


def test_tools_folded_into_the_system_message_give_the_proxy_prompt(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    items = make_dataset(3, 2026)
    rows = verl_data.rows(tok, items, "train")
    for row, item in zip(rows, items):
        proxy = tok.apply_chat_template(messages_for(item["board"]), tools=[CHOOSE_SQUARE_TOOL],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
        verl = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(verl) == list(proxy)
        assert "choose_square" in row["prompt"][0]["content"]
        assert json.loads(row["extra_info"]["item"]) == item


def test_compute_score_is_rlsys_reward():
    item = next(i for i in make_dataset(2423, 0) if i["board"] == "XX.OO....")
    extra = {"item": json.dumps(item)}
    score = verl_reward.compute_score
    assert score("rlsys_tictactoe", '{"name": "choose_square", "arguments": {"square": 3}}', item["board"], extra) == 1.0
    assert score("rlsys_tictactoe", '<tool_call>\n{"name": "choose_square", "arguments": {"square": 5}}\n</tool_call>',
                 item["board"], extra) == -1.0
    assert score("rlsys_tictactoe", "square 3", item["board"], extra) == -1.0
