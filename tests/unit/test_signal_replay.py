"""The data cursor's curriculum (`data.signal_replay`, rlsys/data.py): boards whose group had signal come back
sooner, the fresh boards keep their seeded order, and the queue survives a checkpoint."""
from __future__ import annotations

import json

import pytest

from rlsys.data import DatasetError, ItemStream


def items(n: int = 10) -> list[dict]:
    return [{"id": f"b{i}"} for i in range(n)]


def ids(batch: list[dict]) -> list[str]:
    return [item["id"] for item in batch]


def test_off_by_default_the_order_is_the_plain_seeded_one():
    plain, replaying = ItemStream(items(), seed=3), ItemStream(items(), seed=3)
    first = replaying.next_batch(4)
    replaying.replay(first)  # no-op with replay_frac 0
    assert replaying.queue == []
    assert ids(first) + ids(replaying.next_batch(4)) == ids(plain.next_batch(8))


def test_replayed_boards_lead_the_next_batch_and_fresh_ones_keep_their_order():
    plain = ItemStream(items(), seed=3)
    stream = ItemStream(items(), seed=3, replay_frac=0.5)
    first = stream.next_batch(4)
    stream.replay([first[2], first[0], first[2]])  # queued once each, oldest first
    second = stream.next_batch(4)
    assert ids(second[:2]) == ids([first[2], first[0]])
    assert ids(first) + ids(second[2:]) == ids(plain.next_batch(6))  # the cursor moved by the fresh boards only
    assert stream.queue == []


def test_replay_is_capped_at_the_share_rounded_down():
    stream = ItemStream(items(), seed=1, replay_frac=0.25)
    batch = stream.next_batch(4)
    stream.replay(batch)
    assert stream.next_batch(4)[0] is batch[0] and len(stream.queue) == 3  # int(0.25 x 4) = 1 replayed
    stream.next_batch(3)
    assert len(stream.queue) == 3  # int(0.25 x 3) = 0 replayed


def test_the_queue_survives_a_checkpoint_and_old_checkpoints_load():
    stream = ItemStream(items(), seed=5, replay_frac=0.5)
    batch = stream.next_batch(4)
    stream.replay(batch[1:3])
    state = json.loads(json.dumps(stream.state_dict()))  # as the checkpoint writes it
    resumed = ItemStream(items(), seed=5, replay_frac=0.5)
    resumed.load_state_dict(state)
    assert ids(resumed.next_batch(4)) == ids(stream.next_batch(4))
    old = ItemStream(items(), seed=5, replay_frac=0.5)
    old.load_state_dict({"epoch": 0, "position": 4, "num_items": 10})  # before the queue existed
    assert old.queue == []
    with pytest.raises(DatasetError, match="saved for 10 items"):
        ItemStream(items(9)).load_state_dict(state)


def test_config_bounds():
    from rlsys.config import ConfigError, load_config

    assert load_config().data.signal_replay == 0.0
    assert load_config(overrides=["data.signal_replay=0.25"]).data.signal_replay == 0.25
    with pytest.raises(ConfigError, match="data.signal_replay"):
        load_config(overrides=["data.signal_replay=0.9"])
