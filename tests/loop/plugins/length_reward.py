"""Test reward with spread within every group (the random tiny model never makes a legal call, so the
tic-tac-toe reward would be -1 everywhere and GSPO would have nothing to learn from)."""


def reward(record):
    return (sum(record["output"]["sampled_ids"]) % 7) / 6.0


# the tic-tac-toe error table still applies to what the agent answered
from rlsys.envs.tictactoe.reward import OUTCOMES, outcome  # noqa: E402,F401
