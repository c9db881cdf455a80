"""`python -m jobs.bench step`, `proxy` and `proxy-cpu` on CPU: the real job (tiny model, transformers engine) for two
steps (the first with the engine awake between phases: `rollout.keep_awake`), the direct-engine vs agent-path
comparison, and the proxy's CPU per request; the JSON has every key docs/performance.md reads."""
from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.timeout(300)


def _flags_as_overrides() -> list[str]:
    # the bench takes dotted overrides (its own flags are --steps, --model ...)
    return ["rollout.batch_size=2", "rollout.n_samples=2", "rollout.max_new_tokens=8", "learner.mini_bs=4",
            "data.num_items=16", "logging.tensorboard=false"]


@pytest.mark.parametrize("awake", [False, True], ids=["sleep", "keep-awake"])
def test_bench_step_reports_the_breakdown_of_two_steps(ray_local, tmp_path, capsys, awake):
    from jobs.bench import main

    out = tmp_path / "step.json"
    rc = main(["step", "--config", "configs/tictactoe-tiny-cpu.toml", "--steps", "1", "--warmup", "1",
               "--random-reward", "--run-dir", str(tmp_path / "run"), "--out", str(out), *_flags_as_overrides(),
               f"rollout.keep_awake={str(awake).lower()}"])  # awake: the engines' sleep(0) must not reach the engine
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["steps_timed"] == 1 and r["warmup"] == 1 and len(r["per_step"]) == 2
    phases = r["phases"]
    for name in ("generation", "agent/reward/proxy", "sleep", "train", "  learner compute", "  trajectory fetch",
                 "push", "wake", "canary", "driver/object store", "step"):
        assert phases[name] is not None, f"phase {name!r} missing"
    step = phases["step"]["mean"]
    assert phases["generation"]["mean"] > 0 and phases["  learner compute"]["mean"] > 0
    parts = sum(phases[k]["mean"] for k in ("generation", "agent/reward/proxy", "sleep", "train", "push", "wake",
                                            "canary", "driver/object store"))
    assert parts == pytest.approx(step, rel=1e-6)
    assert 0.0 <= r["overhead_frac"]["mean"] < 1.0
    assert r["tokens_per_s_rollout"]["mean"] > 0 and r["tokens_per_s_generation"]["mean"] > 0
    assert r["memory_gib"] is None and r["gpu_peak_gib"] is None  # no GPU here
    assert r["layout"] == {"world_size": 1, "tp_size": 1, "enforce_eager": False,
                           "keep_awake": awake}
    startup = r["startup"]
    # seconds since this (pytest) process started: ordered, not bounded
    assert 0 < startup["engine_ready_s"] <= startup["job_ready_s"] < startup["first_sample_s"]
    assert 0 < startup["engine_build_s"] < startup["engine_ready_s"]
    from jobs.train import STARTUP_MILESTONES

    # every milestone recorded, in this order (but `rlsys train`'s own first one: this is not that CLI)
    order = [startup[f"{key}_s"] for key, _ in STARTUP_MILESTONES if key != "cli_started"]
    assert order == sorted(order) and order[0] > 0
    assert startup["engine_start_called_s"] + startup["engine_build_s"] == pytest.approx(startup["engine_ready_s"],
                                                                                          abs=0.05)
    # the random reward gave the groups a spread: the learner trained on sequences
    assert all(row.get("time/learner_compute", 0) > 0 for row in r["per_step"])
    assert "overhead 1 - (generation + learner compute)/step" in capsys.readouterr().out


def test_bench_proxy_compares_direct_generation_with_the_agent_path(ray_local, tmp_path, capsys):
    from jobs.bench import main

    out = tmp_path / "proxy.json"
    rc = main(["proxy", "--config", "configs/tictactoe-tiny-cpu.toml", "--rounds", "1", "--out", str(out),
               "--env-workers", "1,2", *_flags_as_overrides()])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["prompts_match"] is True, "the direct path rendered other prompts than the proxy"
    assert r["prompts"] == 2 and r["n_samples"] == 2 and r["concurrency"] == 4
    assert [v["env_workers"] for v in r["by_env_workers"].values()] == [1, 2] and r["env_workers"] == 1
    for v in r["by_env_workers"].values():
        (rnd,) = v["rounds"]
        assert rnd["direct"]["requests"] == rnd["agent"]["requests"] == 4 and rnd["agent"]["failed"] == 0
        assert rnd["direct"]["tokens"] > 0 and rnd["agent"]["tokens"] > 0
        assert math.isclose(v["ratio"], v["agent_tps"] / v["direct_tps"], rel_tol=1e-9)
    assert r["ratio"] == r["by_env_workers"]["1"]["ratio"]
    printed = capsys.readouterr().out
    assert "median with 1 env workers" in printed and "median with 2 env workers" in printed


def test_bench_proxy_cpu_measures_the_servers_cpu_per_request(tmp_path, capsys):
    from jobs.bench import main

    out = tmp_path / "cost.json"
    assert main(["proxy-cpu", "--requests", "16", "--boards", "4", "--rounds", "2", "--new-tokens", "16",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["rounds"]) == 2 and all(x["cpu_s"] > 0 and x["wall_s"] > 0 for x in r["rounds"])
    assert r["cpu_ms_per_request"] > 0 and (r["http"], r["requests"], r["boards"]) == ("auto", 16, 4)
    assert "proxy CPU per request (auto, render cache default)" in capsys.readouterr().out


def test_random_reward_is_deterministic_and_spread():
    from jobs.bench_step import random_reward

    values = [random_reward({"output": {"content": f"move {k}"}}) for k in range(50)]
    assert all(-1.0 <= v <= 1.0 for v in values) and len(set(values)) == 50
    assert random_reward({"output": {"content": "move 3"}}) == values[3]
