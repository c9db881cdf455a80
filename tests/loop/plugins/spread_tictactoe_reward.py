"""Test reward for agents that do not see the sampled ids: the tic-tac-toe reward plus a spread from the output
text (the random tiny model scores -1 everywhere, and a group with one reward gives GSPO nothing to train on)."""
import json
import zlib

from rlsys.envs.tictactoe.reward import OUTCOMES, outcome  # noqa: F401  (the error table still applies)
from rlsys.envs.tictactoe.reward import reward as tictactoe_reward


def reward(record):
    return tictactoe_reward(record) + (zlib.crc32(json.dumps(record["output"]).encode()) % 7) / 60
