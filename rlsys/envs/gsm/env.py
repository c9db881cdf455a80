"""Math word problems with a calculator. Perturbations (perturb.py) run the held-out problems they apply to with
`prompt_variant` set; the agent and the reward both turn that into the perturbed problem (`effective_item`)."""
from __future__ import annotations

from functools import partial

from rlsys.envs.base import Environment, Headline, by_outcomes, shipped_items, tagged
from rlsys.envs.gsm import reward
from rlsys.envs.gsm.agent import agent
from rlsys.envs.gsm.dataset import DATA_DIR, validate_item
from rlsys.envs.gsm.perturb import PERTURBATIONS, perturb


def _applies(kind: str, item: dict) -> bool:
    return perturb(item, kind) is not None


ENV = Environment(
    name="gsm", agent=agent, reward=reward.reward, outcomes=reward.OUTCOMES, outcome=reward.outcome,
    validate_item=validate_item, summarize=by_outcomes(reward.summarize), episode_metrics=reward.episode_metrics,
    train_items=shipped_items(DATA_DIR / "train.jsonl", validate_item),
    heldout_items=shipped_items(DATA_DIR / "heldout.jsonl", validate_item),
    perturbations={kind: tagged(kind, partial(_applies, kind)) for kind in PERTURBATIONS},
    headline=Headline("right", ("right",), "right_rate"))
