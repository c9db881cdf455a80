"""Test reward for the MCP calculator: its reward plus a spread from the sampled ids (the random tiny model
never answers correctly, and a group with one reward gives GSPO nothing to train on)."""
from rlsys.envs.mcp_calculator.reward import OUTCOMES, outcome  # noqa: F401
from rlsys.envs.mcp_calculator.reward import reward as calculator_reward


def reward(record):
    ids = [tok for turn in record["output"]["turns"] for tok in turn["completion_ids"]]
    return calculator_reward(record) + (sum(ids) % 7) / 6.0
