"""Arithmetic with a calculator behind an MCP server (started per episode). Training items only: evaluation needs
an eval file."""
from __future__ import annotations

from pathlib import Path

from rlsys.envs.base import Environment, shipped_items
from rlsys.envs.mcp_calculator import reward
from rlsys.envs.mcp_calculator.agent import agent

ENV = Environment(
    name="mcp_calculator", agent=agent, reward=reward.reward, outcomes=reward.OUTCOMES, outcome=reward.outcome,
    validate_item=reward.validate_item,
    train_items=shipped_items(Path(__file__).with_name("data") / "train.jsonl", reward.validate_item))
