"""Test reward for dynamic sampling: about half the boards are "settled" (every sample scores 0.5, a group without
signal); the others score by the sampled ids, which differ within a group (length_reward.py's rule)."""


def settled(board: str) -> bool:
    return sum(map(ord, board)) % 2 == 0


def reward(record):
    if settled(record["item"]["board"]):
        return 0.5
    return (sum(record["output"]["sampled_ids"]) % 7) / 6.0


def constant(record):
    """Every board settled: dynamic sampling never finds a group with signal."""
    return 0.5
