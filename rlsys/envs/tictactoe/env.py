"""The single-move tic-tac-toe environment (the default): one mid-game board, one `choose_square` call."""
from __future__ import annotations

from typing import TYPE_CHECKING

from rlsys.envs.base import Environment, Headline, tagged
from rlsys.envs.tictactoe import reward
from rlsys.envs.tictactoe.agent import agent, first_request
from rlsys.envs.tictactoe.dataset import make_dataset
from rlsys.envs.tictactoe.prompt import PERTURBATIONS
from rlsys.envs.tictactoe.sft_data import make_sft_dataset

if TYPE_CHECKING:
    from rlsys.config import DataConfig


def train_items(data: DataConfig) -> list[dict]:
    """`num_items` distinct boards of seed `seed`."""
    return make_dataset(data.num_items, data.seed)


def heldout_items(data: DataConfig) -> list[dict]:
    """`num_eval_items` boards of seed `seed + 1`, none of them a training board."""
    return make_dataset(data.num_eval_items, data.seed + 1, exclude=[it["board"] for it in train_items(data)])


def sft_items(data: DataConfig) -> list[dict]:
    """Format-only chats (a random square) over the training boards."""
    return make_sft_dataset(train_items(data), data.num_items, data.seed)


def summarize(items: list[dict], outcomes: list[str]) -> dict[str, float]:
    """The rates over all boards, then by kind of board (reward.py)."""
    return {**reward.summarize(outcomes), **reward.summarize_by_kind(items, outcomes)}


ENV = Environment(
    name="tictactoe", agent=agent, reward=reward.reward, outcomes=reward.OUTCOMES, outcome=reward.outcome,
    validate_item=reward.validate_item, summarize=summarize, train_items=train_items, heldout_items=heldout_items,
    sft_items=sft_items, perturbations={v: tagged(v) for v in PERTURBATIONS}, first_request=first_request,
    episode_metrics=reward.episode_metrics,
    headline=Headline("legal_move", ("legal_suboptimal", "optimal", "win"), "legal_move_rate"))
