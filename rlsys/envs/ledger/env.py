"""The ticket ledger. Its held-out split is already presented differently (renamed fields, shuffled records), so
there are no extra evaluation perturbations."""
from __future__ import annotations

from rlsys.envs.base import Environment, Headline, by_outcomes, seeded_items, shipped_items
from rlsys.envs.ledger import reward
from rlsys.envs.ledger.agent import agent
from rlsys.envs.ledger.dataset import DATA_DIR, validate_item
from rlsys.envs.ledger.sft_data import make_sft_dataset


ENV = Environment(
    name="ledger", agent=agent, reward=reward.reward, outcomes=reward.OUTCOMES, outcome=reward.outcome,
    validate_item=validate_item, summarize=by_outcomes(reward.summarize),
    train_items=shipped_items(DATA_DIR / "train.jsonl", validate_item),
    heldout_items=shipped_items(DATA_DIR / "heldout.jsonl", validate_item), sft_items=seeded_items(make_sft_dataset),
    headline=Headline("solved", ("solved", "solved_with_refusals"), "solved_rate"))
