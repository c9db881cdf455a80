"""`python -m jobs.bench learner` on a small shape: both row orders train on the same batches, and the sorted one
pads less."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)


def test_synthetic_batches_have_the_job_shape_and_an_advantage_everywhere():
    from jobs.bench_learner import synthetic_batch

    batch = synthetic_batch(3, 4, 10, (5, 50), vocab=100, seed=0)
    assert len(batch) == 12 and [t.group for t in batch[:3]] == [0, 1, 2]  # groups interleaved, as sampled
    for group in range(3):
        rows = [t for t in batch if t.group == group]
        assert len({tuple(t.segments[0].input_ids[:10]) for t in rows}) == 1  # one prompt a group
        assert len({t.reward for t in rows}) == 4  # distinct rewards: every answer has an advantage
        for t in rows:
            seg = t.segments[0]
            assert 5 <= seg.num_sampled <= 50 and seg.loss_mask[:10] == [0] * 10 and max(seg.input_ids) < 100
    assert synthetic_batch(3, 4, 10, (5, 50), vocab=100, seed=0)[5].segments[0].input_ids == \
        batch[5].segments[0].input_ids  # the same seed, the same batch for every variant
    # --common-tokens: every prompt opens with the same tokens (a system prompt), then the group's own
    heads = {tuple(t.segments[0].input_ids[:10]) for t in synthetic_batch(3, 4, 10, (5, 50), vocab=100, seed=0,
                                                                           common_tokens=6)}
    assert len(heads) == 3 and len({h[:6] for h in heads}) == 1
    with pytest.raises(ValueError, match="common_tokens"):
        synthetic_batch(3, 4, 10, (5, 50), vocab=100, seed=0, common_tokens=11)


def test_bench_learner_measures_both_orders_on_the_same_batches(tmp_path, capsys):
    from jobs.bench import main

    out = tmp_path / "learner.json"
    rc = main(["learner", "--config", "configs/tictactoe-tiny-cpu.toml", "--model", "rlsys:tiny", "--groups", "2",
               "--samples", "4", "--prompt-tokens", "20", "--answer-min", "4", "--answer-max", "120", "--steps", "1",
               "--warmup", "0", "--out", str(out), "learner.mini_bs=2"])
    assert rc == 0
    r = json.loads(out.read_text())
    sorted_, sampled = r["variants"]["sorted"], r["variants"]["sampled"]
    assert sorted_["mini_bs"] == 2 and sorted_["tokens_per_s"] > 0 and sampled["tokens_per_s"] > 0
    assert sorted_["padded_frac"] < sampled["padded_frac"]  # short answers no longer pad to long ones
    assert sorted_["loss"][0] == pytest.approx(sampled["loss"][0], rel=1e-4, abs=1e-6)  # the same update
    assert "padded" in capsys.readouterr().out


def test_bench_learner_variants_by_token_budget_run_fewer_micro_batches(tmp_path):
    from jobs.bench import main

    out = tmp_path / "learner.json"
    rc = main(["learner", "--config", "configs/tictactoe-tiny-cpu.toml", "--model", "rlsys:tiny", "--groups", "2",
               "--samples", "4", "--prompt-tokens", "20", "--answer-min", "4", "--answer-max", "40", "--steps", "1",
               "--warmup", "0", "--out", str(out), "--variant", "rows=learner.mini_bs=2",
               "--variant", "tokens=learner.micro_batch_tokens=240"])
    assert rc == 0
    r = json.loads(out.read_text())["variants"]
    assert r["rows"]["micro_batches"] == 4  # 8 answers, 2 a micro-batch
    assert r["tokens"]["micro_batches"] < r["rows"]["micro_batches"]  # rows of 24-60 tokens: 4+ fit 240 positions
    assert r["tokens"]["loss"][0] == pytest.approx(r["rows"]["loss"][0], rel=1e-4, abs=1e-6)  # the same update


def test_bench_learner_on_a_config_with_the_reference_actor_annotates_the_batches_as_the_job_does(tmp_path):
    """`learner.reference_actor`: the job's reference runs apart, so the benchmark annotates the batches first (a
    learner given none refuses them) and times the learner alone; the losses are those of a learner that runs the
    reference itself."""
    from jobs.bench import main

    out = tmp_path / "learner.json"
    rc = main(["learner", "--config", "configs/tictactoe-tiny-cpu.toml", "--model", "rlsys:tiny", "--groups", "2",
               "--samples", "4", "--prompt-tokens", "200", "--answer-min", "4", "--answer-max", "40", "--steps", "3",
               "--warmup", "1", "--out", str(out), "--variant", "inside=learner.reference_actor=false",
               "--variant", "apart=learner.reference_actor=true", "algo.kl_coef=0.1"])
    assert rc == 0
    r = json.loads(out.read_text())["variants"]
    assert r["inside"]["loss"] == pytest.approx(r["apart"]["loss"], rel=1e-5, abs=1e-7)  # the same penalty
