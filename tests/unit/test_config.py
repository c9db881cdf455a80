"""The config tree: precedence, round trip, and errors that name the field and its source."""
from __future__ import annotations

import argparse

import pytest

from rlsys.config import (
    FLAGS,
    Config,
    ConfigError,
    add_config_args,
    config_from_args,
    describe_fields,
    dump_config,
    load_config,
)


def _parse(argv: list[str]) -> Config:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_are_valid_and_get_a_run_dir():
    cfg = load_config()
    assert cfg.algo.name == "gspo"
    assert cfg.rollout.batch_size == 4 and cfg.rollout.n_samples == 4
    assert cfg.run_dir.startswith("runs/gspo-")
    assert cfg.algo.clip_eps() == (3e-4, 4e-4)


def test_precedence_file_then_flags_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('seed = 1\n[learner]\nlr = 1e-3\nmini_bs = 2\n[algo]\nname = "grpo"\n')
    cfg = load_config(f, flags={"--lr": "2e-4", "--seed": "5"}, overrides=["learner.lr=3e-4"])
    assert cfg.seed == 5  # flag beats file
    assert cfg.learner.lr == 3e-4  # override beats flag
    assert cfg.learner.mini_bs == 2  # file beats default
    assert cfg.algo.clip_eps() == (0.2, 0.28)  # GRPO defaults


def test_every_areno_flag_parses():
    argv = [
        "--algo", "grpo", "--ckpt", "some/folder", "--dataset-path", "d.jsonl", "--reward-fn-path", "r.py",
        "--agent-fn", "a.py:run", "--world-size", "2", "--tp-size", "2", "--batch-size", "8",
        "--n-samples", "8", "--mini-bs", "4", "--max-new-tokens", "32", "--temperature", "0.7",
        "--lr", "1e-6", "--adam-8bit", "--drop-rollout-state", "--save-path", "ck", "--save-interval", "10",
        "--metrics-log-dir", "tb", "--max-steps", "7", "--seed", "3", "--run-dir", "runs/x",
        "algo.clip_eps_low=0.1",
    ]
    cfg = _parse(argv)
    assert (cfg.algo.name, cfg.model.ckpt, cfg.data.dataset_path) == ("grpo", "some/folder", "d.jsonl")
    assert (cfg.env.reward_fn_path, cfg.env.agent_fn) == ("r.py", "a.py:run")
    assert (cfg.cluster.world_size, cfg.cluster.tp_size) == (2, 2)
    assert (cfg.rollout.batch_size, cfg.rollout.n_samples, cfg.learner.mini_bs) == (8, 8, 4)
    assert cfg.rollout.max_new_tokens == 32 and cfg.rollout.temperature == 0.7 and cfg.learner.lr == 1e-6
    assert cfg.learner.adam_8bit and cfg.rollout.drop_rollout_state
    assert (cfg.checkpoint.save_path, cfg.checkpoint.save_interval) == ("ck", 10)
    assert cfg.logging.metrics_log_dir == "tb" and cfg.max_steps == 7 and cfg.seed == 3
    assert cfg.run_dir == "runs/x" and cfg.algo.clip_eps_low == 0.1
    # every flag of the table is reachable from the command line
    assert {a for a in argv if a.startswith("--")} <= set(FLAGS)


def test_env_flag_picks_the_environment_by_name():
    assert _parse(["--env", "gsm"]).env.name == "gsm"
    assert _parse(["--env", "gsm"]).env.environment().name == "gsm"


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"flags": {"--lr": "abc"}}, "learner.lr: Input should be a valid number"),
        ({"flags": {"--lr": "-1"}}, "learner.lr: Input should be greater than 0"),
        ({"overrides": ["algo.bogus=1"]}, "algo.bogus: unknown key [from override algo.bogus=1]"),
        ({"overrides": ["nosuch.section.x=1"]}, "nosuch: unknown key"),
        ({"overrides": ["algo.name=ppo"]}, "algo.name: Input should be 'gspo', 'grpo' or 'sft'"),
        ({"overrides": ["rollout.n_samples=1"]}, "rollout.n_samples: gspo needs >= 2 samples"),
        ({"overrides": ["learner.mini_bs=3"]}, "learner.mini_bs: 3 does not divide a minibatch of 16"),
        ({"overrides": ["algo.n_minibatches=3"]}, "algo.n_minibatches: 3 does not divide"),
        ({"flags": {"--world-size": "3", "--tp-size": "2"}}, "cluster.tp_size: 2 does not divide"),
        ({"overrides": ["rollout.max_new_tokens=4096"]}, "rollout.max_new_tokens: 4096 leaves no room"),
        ({"overrides": ["learner.lr"]}, "expected KEY=VALUE"),
        ({"overrides": ["learner=3", "learner.lr=1"]}, "learner: is a value"),
        ({"flags": {"--keep-awake": True, "--drop-rollout-state": True}}, "rollout.keep_awake: the engine never sleeps"),
        ({"overrides": ["rollout.overlap=true", "rollout.keep_awake=false"]}, "rollout.overlap: the engines sample"),
        ({"flags": {"--drop-rollout-state": True}, "overrides": ["rollout.overlap=true"]}, "rollout.overlap: the"),
    ],
)
def test_errors_name_the_field(kwargs, expected):
    with pytest.raises(ConfigError) as err:
        load_config(**kwargs)
    assert expected in str(err.value)


def test_sleep_level_and_executor_follow_the_rollout_settings():
    assert load_config().sleep_level() == 1 and not load_config().vllm_ray_executor()
    assert load_config(flags={"--drop-rollout-state": True}).sleep_level() == 2
    assert load_config(flags={"--keep-awake": True}).sleep_level() == 0
    # keep_awake auto (the default): awake only where the driver's memory check passed
    assert load_config().rollout.keep_awake == "auto" and load_config().sleep_level(awake_fits=True) == 0
    assert load_config(flags={"--drop-rollout-state": True}).sleep_level(awake_fits=True) == 2
    assert load_config(overrides=["rollout.keep_awake=false"]).sleep_level(awake_fits=True) == 1
    assert load_config(overrides=["rollout.overlap=true"]).sleep_level() == 0  # it samples while the learner trains
    assert load_config(flags={"--world-size": "2", "--tp-size": "2"}).vllm_ray_executor()
    assert load_config(overrides=["rollout.executor=ray"]).vllm_ray_executor()


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner]\nlr = = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: invalid TOML: .*line 2"):
        load_config(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[learner]\nmini_bs = "four"\n')
    with pytest.raises(ConfigError, match=r"learner.mini_bs: .*valid integer.*\[from file .*wrong.toml\]"):
        load_config(wrong)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_override_values_are_parsed_as_toml():
    cfg = load_config(overrides=["learner.betas=[0.8, 0.95]", "logging.progress=false", "model.ckpt=a/b"])
    assert cfg.learner.betas == (0.8, 0.95)
    assert cfg.logging.progress is False
    assert cfg.model.ckpt == "a/b"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(flags={"--lr": "5e-6", "--run-dir": str(tmp_path / "run")}, overrides=["algo.tis_cap=3.0"])
    out = tmp_path / "config.resolved.toml"
    dump_config(cfg, out)
    assert load_config(out) == cfg


def test_every_field_is_documented():
    rows = describe_fields()
    assert len(rows) > 40
    undocumented = [name for name, _, doc in rows if not doc.strip()]
    assert undocumented == []


def test_import_rlsys_pulls_no_ray_or_vllm():
    import subprocess
    import sys

    code = "import rlsys, rlsys.config, rlsys.types, rlsys.cli, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_env_num_workers_auto_is_half_of_each_engine_nodes_cpus_within_bounds():
    from rlsys.config import Config

    auto = Config().env
    assert auto.num_workers == "auto"
    assert auto.worker_count([2.0]) == 2, "a 2-core box keeps two workers"
    assert auto.worker_count([16.0]) == 8 and auto.worker_count([128.0]) == 8
    assert auto.worker_count([16.0, 6.0]) == 8 + 3, "counted per engine node"
    assert auto.worker_count([0.0]) == 2, "an unknown node counts as 4 CPUs"
    fixed = Config.model_validate({"env": {"num_workers": 5}}).env
    assert fixed.worker_count([128.0]) == 5
    for bad in ("many", 0):
        with pytest.raises(Exception, match="num_workers"):
            Config.model_validate({"env": {"num_workers": bad}})
