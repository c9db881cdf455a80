"""Whole tic-tac-toe games against a seeded opponent. The held-out split already varies the prompt (each item's
`prompt_variant`), so there are no extra evaluation perturbations."""
from __future__ import annotations

from rlsys.envs.base import Environment, Headline, by_outcomes, seeded_items, shipped_items
from rlsys.envs.tictactoe_game import reward
from rlsys.envs.tictactoe_game.agent import agent
from rlsys.envs.tictactoe_game.dataset import DATA_DIR, validate_item
from rlsys.envs.tictactoe_game.sft_data import make_sft_dataset


ENV = Environment(
    name="tictactoe_game", agent=agent, reward=reward.reward, outcomes=reward.OUTCOMES, outcome=reward.outcome,
    validate_item=validate_item, summarize=by_outcomes(reward.summarize),
    train_items=shipped_items(DATA_DIR / "train.jsonl", validate_item),
    heldout_items=shipped_items(DATA_DIR / "heldout.jsonl", validate_item), sft_items=seeded_items(make_sft_dataset),
    headline=Headline("win", ("win",), "win_rate"))
