"""The math word problem environment (rlsys/envs/gsm) in the CPU job: configs/gsm-tiny-cpu.toml for a few steps
with the tiny model under a real local Ray, then a held-out evaluation of a few problems.

Plumbing, not learning: the random tiny model almost never writes a valid call, so most episodes end after one
turn as 'no_answer'. Checked whatever it wrote: every trajectory is recorded and labelled with the env's outcomes,
rewards are in {-1, 0, 1} and equal the reward table's for the label, the loss mask is 1 exactly on the sampled
tokens (so tool results are out of the loss), an episode has more than one turn only where every earlier turn
was a calculate call, the step's error table lists every outcome, the learner steps, and the evaluation reports
the env's rates, also under each of its perturbations. (The scripted-model checks of multi-turn episodes are in tests/unit/test_gsm_agent.py.)
"""
from __future__ import annotations

import json
import math

import pytest

from tests.loop.conftest import REPO

pytestmark = pytest.mark.timeout(400)
STEPS = 3
EVAL_ITEMS = 4


def check_trajectory(t) -> str:
    from rlsys.envs.gsm.reward import OUTCOMES, REWARD_BY_OUTCOME

    assert not t.failed, t.fail_reason
    assert t.outcome in OUTCOMES and t.reward == REWARD_BY_OUTCOME[t.outcome]
    out = t.info["output"]
    turns = out["turns"]
    assert t.num_turns == len(turns) >= 1 and len(turns) <= 6
    # a next turn follows calculate calls (each answered by a tool message) or, once, a text-only turn (the nudge)
    for earlier in turns[:-1]:
        assert all(c["name"] == "calculate" for c in earlier["tool_calls"]), earlier
    assert sum(not turn["tool_calls"] for turn in turns[:-1]) <= 1
    assert len(out["calculations"]) >= sum(len(turn["tool_calls"]) for turn in turns[:-1])
    calcs = out["calculations"]  # the environment's per-episode scalars, computed in the env worker
    assert t.metrics == {"calculator_calls": float(len(calcs)), "used_calculator": float(bool(calcs)),
                         "calculator_errors": float(sum(not c["ok"] for c in calcs)),
                         "right_with_calculator": float(bool(calcs) and t.outcome == "right")}
    sampled = [tok for s in t.segments for tok, m in zip(s.input_ids, s.loss_mask) if m]
    assert sampled == [tok for turn in turns for tok in turn["completion_ids"]], "loss mask is not on sampled ids"
    assert all(len(s.loss_mask) == len(s.input_ids) for s in t.segments)
    return t.outcome


def test_gsm_job_runs_a_few_steps_on_the_tiny_model_and_evaluates(ray_local, tmp_path):
    import ray

    from jobs.job import Job
    from rlsys.config import load_config
    from rlsys.envs.gsm.reward import OUTCOMES
    from rlsys.metrics import rollout_metrics

    heldout = tmp_path / "heldout.jsonl"
    lines = (REPO / "rlsys/envs/gsm/data/heldout.jsonl").read_text().splitlines()[:EVAL_ITEMS]
    heldout.write_text("\n".join(lines) + "\n")
    cfg = load_config(REPO / "configs/gsm-tiny-cpu.toml",
                      flags={"--run-dir": str(tmp_path / "run"), "--max-steps": str(STEPS)},
                      overrides=["logging.progress=false", "eval.at_end=true", "eval.perturb=true",
                                 f"data.dataset_path='{REPO / 'rlsys/envs/gsm/data/train.jsonl'}'",
                                 f"data.eval_path='{heldout}'"])
    assert cfg.env.name == "gsm" and cfg.rollout.n_samples * cfg.rollout.batch_size == 8
    job = Job.start(cfg)
    seen: list[str] = []
    multi_turn = 0
    try:
        for step in range(STEPS):
            traj_refs, summaries = job.rollout(job.data.next_batch(cfg.rollout.batch_size), step=step)
            trajs = ray.get(traj_refs)
            assert len(trajs) == 8
            seen += [check_trajectory(t) for t in trajs]
            multi_turn += sum(t.num_turns > 1 for t in trajs)
            metrics = rollout_metrics(summaries, job.outcome_labels)
            assert {k.removeprefix("error/") for k in metrics if k.startswith("error/")} == set(OUTCOMES)
            assert math.isclose(sum(metrics[f"error/{o}"] for o in OUTCOMES), 1.0)
            assert metrics["episode/used_calculator"] == sum(bool(t.info["output"]["calculations"]) for t in trajs) / 8
            job.engines.sleep(level=2)
            stats = job.train(traj_refs, summaries)
            assert stats["train/skipped_steps"] == 0 and math.isfinite(stats["train/loss"]), stats
            job.weights.push()
            job.engines.wake()
        evaluated = job.evaluate("end", tmp_path / "evals" / "end-examples.json")
    finally:
        job.shutdown()
    print(f"gsm tiny: outcomes {json.dumps({o: seen.count(o) for o in OUTCOMES})}, {multi_turn} multi-turn episodes")
    assert evaluated["eval/num_trajectories"] == EVAL_ITEMS and evaluated["eval/failed_frac"] == 0.0
    for key in ("eval/right_rate", "eval/answered_rate", "eval/malformed_call_rate"):
        assert 0.0 <= evaluated[key] <= 1.0, key
    assert -1.0 <= evaluated["eval/rewards_mean"] <= 1.0
    assert 0.0 <= evaluated["eval/episode/used_calculator"] <= 1.0  # the calculator-use rate, before/after in runs
    # a few held-out episodes of each outcome, with the model's turns, beside the counts
    examples = json.loads((tmp_path / "evals" / "end-examples.json").read_text())["by_outcome"]
    assert examples and set(examples) <= set(OUTCOMES)
    assert sum(len(v) for v in examples.values()) <= EVAL_ITEMS
    for label, episodes in examples.items():
        assert all(e["outcome"] == label and e["output"]["turns"] for e in episodes), label
    # eval.perturb runs the environment's own perturbations, each on the held-out problems it applies to
    from rlsys.envs.gsm.perturb import PERTURBATIONS, perturb

    items = [json.loads(line) for line in lines]
    for kind in PERTURBATIONS:
        applies = sum(perturb(item, kind) is not None for item in items)
        assert evaluated[f"eval/{kind}/num_trajectories"] == applies and applies > 0, kind
        assert evaluated[f"eval/{kind}/failed_frac"] == 0.0, kind
        assert 0.0 <= evaluated[f"eval/{kind}/right_rate"] <= 1.0, kind
