"""`learner.micro_batch_tokens`: micro-batches cut by padded positions (actors/learner_rows.py `micro_batches`), the config
check it relaxes, and the memory estimate that follows it."""
from __future__ import annotations

import pytest

from actors.learner_rows import Row, micro_batches
from rlsys.config import load_config
from rlsys.memory import JobShape, ModelShape, estimate
from rlsys.types import Segment


def _rows(lengths: list[int]) -> list[Row]:
    return [Row(Segment(list(range(n)), [1] * n, [0.0] * n), 1.0, i) for i, n in enumerate(lengths)]


def test_without_a_budget_micro_batches_are_mini_bs_rows():
    rows = _rows([5, 7, 3, 9, 2])
    assert [[r.group for r in m] for m in micro_batches(rows, 2)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("budget", [1, 10, 20, 27, 40, 1000])
def test_a_budget_keeps_the_order_and_every_row_once_and_each_micro_batch_within_it(budget):
    lengths = [5, 7, 3, 9, 2, 12, 12, 1, 30, 4]
    micro = micro_batches(_rows(lengths), 2, budget)
    assert [r.group for m in micro for r in m] == list(range(len(lengths)))  # in order, each row once
    for m in micro:
        padded = len(m) * max(len(r.segment.input_ids) for r in m)
        assert padded <= budget or len(m) == 1, (budget, [len(r.segment.input_ids) for r in m])
    # greedy: the next row would have broken the budget of the micro-batch before it
    for a, b in zip(micro, micro[1:]):
        assert (len(a) + 1) * max(len(r.segment.input_ids) for r in a + b[:1]) > budget
    if budget >= 2 * max(lengths):
        assert len(micro) < len(lengths) / 2  # a budget that holds several rows beats mini_bs=2


def test_the_budget_frees_mini_bs_from_dividing_the_minibatch(tmp_path):
    flags = {"--run-dir": str(tmp_path / "r"), "--mini-bs": "3", "--batch-size": "4", "--n-samples": "4"}
    with pytest.raises(ValueError, match="learner.mini_bs: 3 does not divide"):
        load_config(flags=flags)
    cfg = load_config(flags=flags, overrides=["learner.micro_batch_tokens=8192"])
    assert cfg.learner.micro_batch_tokens == 8192
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        load_config(flags={"--run-dir": str(tmp_path / "r")}, overrides=["learner.micro_batch_tokens=0"])


def test_the_memory_estimate_follows_the_budget(tmp_path):
    from tests.unit.test_memory import QWEN15B

    shape = ModelShape.from_config(QWEN15B)
    rows = JobShape(mini_bs=4, seq_len=1024, max_model_len=1024)
    small = JobShape(mini_bs=4, seq_len=1024, max_model_len=1024, micro_batch_tokens=2048)
    large = JobShape(mini_bs=4, seq_len=1024, max_model_len=1024, micro_batch_tokens=16384)
    alone = JobShape(mini_bs=4, seq_len=1024, max_model_len=1024, micro_batch_tokens=100)  # a row runs alone
    assert (small.micro_tokens, large.micro_tokens, alone.micro_tokens, rows.micro_tokens) == (2048, 16384, 1024, 4096)
    act = {k: estimate(shape, j).learner["activations"] for k, j in
           (("rows", rows), ("small", small), ("large", large))}
    assert act["small"] < act["rows"] < act["large"]
    assert "2048 padded tokens" in estimate(shape, small).table()
    cfg = load_config(flags={"--run-dir": str(tmp_path / "r")}, overrides=["learner.micro_batch_tokens=4096"])
    assert JobShape.from_config(cfg).micro_batch_tokens == 4096
