"""scripts/peers/trl_gspo.py's adapters: the TRL peer must score and prompt exactly as rlsys does (issue 25).

Only the parts that need neither TRL nor a GPU: the prompt text, the completion -> agent output -> rlsys reward path.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlsys.config import load_config
from rlsys.envs.tictactoe.dataset import make_dataset
from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for

REPO = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("trl_gspo", REPO / "scripts/peers/trl_gspo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer = _load_script()

# X on 1 and 2, O on 4 and 5: square 3 wins
WIN_BOARD = "XX.OO...."


def _item(board: str) -> dict:
    return next(item for item in make_dataset(2423, 0) if item["board"] == board)


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>\n{"name": "choose_square", "arguments": {"square": 3}}\n</tool_call>', 1.0),
    ('```json\n{"name": "choose_square", "arguments": {"square": 3}}\n```', 1.0),
    ('{"name": "choose_square", "arguments": {"square": 4}}', -1.0),  # occupied
    ('{"name": "choose_square", "arguments": {"square": "3"}}', -1.0),  # a string, not an integer
    ("I would play square 3.", -1.0),  # prose, no call
    ('{"name": "choose_square", "arguments": {"squ', -1.0),  # cut off
])
def test_agent_output_scores_like_rlsys(text, expected):
    from rlsys.envs.tictactoe.reward import reward

    assert reward({"item": _item(WIN_BOARD), "output": peer.agent_output(text)}) == expected


def test_reward_decodes_ids_like_the_proxy(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    fn = peer.TicTacToeReward(tok)
    item = _item(WIN_BOARD)
    win = tok.encode('<tool_call>\n{"name": "choose_square", "arguments": {"square": 3}}\n</tool_call>',
                     add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    prose = tok.encode("square 3", add_special_tokens=False)
    rewards = fn(prompts=["p", "p"], completions=["", ""], completion_ids=[win, prose], id=[item["id"]] * 2,
                 board=[item["board"]] * 2, legal_moves=[item["legal_moves"]] * 2, best_moves=[item["best_moves"]] * 2)
    assert rewards == [1.0, -1.0]
    assert fn.outcomes == {"win": 1, "no_tool_call": 1}


def test_prompts_are_rlsys_training_boards_rendered_with_the_tool(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = load_config(REPO / "configs/tictactoe-qwen0.5b.toml")
    rows = peer.training_rows(cfg, tok)
    assert [r["board"] for r in rows] == [i["board"] for i in make_dataset(cfg.data.num_items, cfg.data.seed)]
    first = rows[0]
    assert "choose_square" in first["prompt"]
    # what TRL tokenizes (the text, no special tokens added) is what rlsys's proxy sends to the engine
    proxy_ids = tok.apply_chat_template(messages_for(first["board"]), tools=[CHOOSE_SQUARE_TOOL],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok(first["prompt"])["input_ids"] == list(proxy_ids)


def test_peft_config_mirrors_the_configs_lora():
    cfg = load_config(REPO / "configs/tictactoe-qwen0.5b.toml")
    assert cfg.learner.lora.enabled  # the GPU recipe trains LoRA: so must the peer
    lora = peer.peft_config(cfg)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (cfg.learner.lora.rank, cfg.learner.lora.alpha,
                                                            cfg.learner.lora.dropout)
    assert set(lora.target_modules) == set(cfg.learner.lora.target_modules)
    full = cfg.model_copy(update={"learner": cfg.learner.model_copy(
        update={"lora": cfg.learner.lora.model_copy(update={"enabled": False})})})
    assert peer.peft_config(full) is None
