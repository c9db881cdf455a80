"""The environment interface (rlsys/envs/base.py): the registry, the `Environment` checks, the old agent/reward
plug-in adapter, the built-in environments' items and perturbations, and that the framework names no environment."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlsys.config import DataConfig, EnvConfig
from rlsys.envs import ENVIRONMENTS, Environment, load_environment, resolve_environment
from rlsys.plugins import PluginError

REPO = Path(__file__).resolve().parents[2]
SMALL = DataConfig(num_items=8, num_eval_items=4, seed=3)


async def _agent(item, client, model):
    return ""


def _reward(record):
    return 0.0


# --- the registry ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ENVIRONMENTS))
def test_every_built_in_environment_loads_with_its_reward_modules_labels_and_valid_items(name):
    import importlib

    env = load_environment(name)
    reward = importlib.import_module(f"rlsys.envs.{name}.reward")
    assert env.name == name and env.reward is reward.reward and env.outcomes == tuple(reward.OUTCOMES)
    assert env.outcome is reward.outcome and env.validate_item is not None
    for item in env.train_items(SMALL)[:4]:
        env.validate_item(item)
    for item in (env.heldout_items(SMALL)[:4] if env.heldout_items else []):
        env.validate_item(item)


def test_the_default_environment_is_tictactoe_and_the_config_resolves_to_the_same_object():
    from rlsys.envs.tictactoe.env import ENV

    assert EnvConfig().name == "tictactoe" and EnvConfig().environment() is ENV and resolve_environment() is ENV
    assert resolve_environment("gsm") is load_environment("gsm")


def test_tictactoe_items_are_the_generated_boards_and_held_out_ones_are_disjoint():
    env = load_environment("tictactoe")
    train, held_out = env.train_items(SMALL), env.heldout_items(SMALL)
    assert len(train) == 8 and len(held_out) == 4
    assert not {it["board"] for it in train} & {it["board"] for it in held_out}
    assert all(chat["messages"][-1]["role"] == "assistant" for chat in env.sft_items(SMALL))


def test_an_unknown_name_or_a_module_without_an_environment_is_refused_naming_what_exists(tmp_path):
    with pytest.raises(PluginError, match="not a built-in environment .*tictactoe.*gsm"):
        load_environment("chess")
    other = tmp_path / "other.py"
    other.write_text("ENV = 3\n")
    with pytest.raises(PluginError, match="is a int, not an rlsys.envs.Environment"):
        load_environment(f"{other}:ENV")
    with pytest.raises(PluginError, match="no Environment 'ENV'"):
        load_environment("rlsys.envs.tictactoe.game:ENV")


def test_a_user_environment_file_loads_by_path_and_default_attribute_name(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent("""
        from rlsys.envs import Environment

        async def agent(item, client, model):
            return "hi"

        ENV = Environment(name="mine", agent=agent, reward=lambda record: 1.0)
    """))
    env = load_environment(str(path))
    assert env.name == "mine" and env.reward({}) == 1.0 and env.rates([{}], ["x"]) == {}


# --- Environment's own checks ---------------------------------------------------------------------------------
def test_environment_refuses_a_plain_agent_an_async_reward_a_default_variant_and_repeated_labels():
    def plain_agent(item, client, model):
        return ""

    async def async_reward(record):
        return 0.0

    with pytest.raises(ValueError, match="agent must be `async def"):
        Environment(name="x", agent=plain_agent, reward=_reward)
    with pytest.raises(ValueError, match="reward must be a plain"):
        Environment(name="x", agent=_agent, reward=async_reward)
    with pytest.raises(ValueError, match="'default' is the unperturbed prompt"):
        Environment(name="x", agent=_agent, reward=_reward, perturbations={"default": list})
    with pytest.raises(ValueError, match="repeat a label"):
        Environment(name="x", agent=_agent, reward=_reward, outcomes=("a", "b", "a"))


def test_label_order_follows_the_outcomes_and_puts_other_labels_after_by_name():
    env = Environment(name="x", agent=_agent, reward=_reward, outcomes=("bad", "good"))
    labels = ["worker_died", "good", "agent_error", "bad"]
    assert sorted(labels, key=env.label_order) == ["bad", "good", "agent_error", "worker_died"]


# --- perturbations ----------------------------------------------------------------------------------------------
def test_tictactoe_perturbations_tag_every_item_with_their_variant():
    env = load_environment("tictactoe")
    items = env.heldout_items(SMALL)
    for name, perturb in env.perturbations.items():
        out = perturb(items)
        assert [it["board"] for it in out] == [it["board"] for it in items]
        assert {it["prompt_variant"] for it in out} == {name}
    assert "prompt_variant" not in items[0]  # the held-out items themselves are untouched


def test_gsm_perturbations_run_only_the_items_they_apply_to_and_the_reward_scores_the_perturbed_problem():
    from rlsys.envs.gsm.perturb import effective_item, perturb

    env = load_environment("gsm")
    held_out = env.heldout_items(SMALL)[:40]
    names = env.perturbations["names"](held_out)
    assert 0 < len(names) < len(held_out)  # some problems have no first name to replace
    assert [it["id"] for it in names] == [it["id"] for it in held_out if perturb(it, "names") is not None]
    item = env.perturbations["numbers"](held_out)[0]
    perturbed = effective_item(item)
    answer_call = {"id": "c", "name": "answer", "arguments": json.dumps({"value": perturbed["answer"]})}
    turn = {"content": None, "tool_calls": [answer_call], "finish_reason": "tool_calls", "tool_call_errors": [],
            "completion_ids": [1, 2]}
    record = {"item": item, "output": {"turns": [turn]}}
    assert perturbed["answer"] != item["answer"] or perturbed["question"] != item["question"]
    assert env.outcome(record) == "right"


def test_environments_whose_held_out_split_is_already_perturbed_have_no_extra_variants():
    assert load_environment("ledger").perturbations == {} and load_environment("tictactoe_game").perturbations == {}


# --- the old plug-ins -------------------------------------------------------------------------------------------
def test_plugins_naming_the_environments_own_functions_change_nothing():
    env = load_environment("tictactoe")
    assert resolve_environment("tictactoe", "rlsys.envs.tictactoe.agent:agent",
                               "rlsys.envs.tictactoe.reward:reward") is env
    gsm = load_environment("gsm")
    assert resolve_environment("gsm", "rlsys.envs.gsm.agent:agent", "rlsys.envs.gsm.reward:reward") is gsm


def test_a_config_from_before_env_name_naming_a_built_in_envs_plugins_gets_that_whole_environment():
    gsm = load_environment("gsm")
    old_style = EnvConfig(agent_fn="rlsys.envs.gsm.agent:agent", reward_fn_path="rlsys.envs.gsm.reward:reward")
    assert old_style.environment() is gsm and gsm.perturbations
    mixed = resolve_environment("tictactoe", "rlsys.envs.tictactoe.agent:agent", "rlsys.envs.gsm.reward:reward")
    assert mixed.name == "tictactoe+plugins" and mixed.outcomes == gsm.outcomes
    assert mixed.headline is None  # tic-tac-toe's legal-move labels are not the new reward's


def test_a_headline_counting_unknown_outcomes_is_refused():
    from dataclasses import replace

    from rlsys.envs import Headline

    env = load_environment("tictactoe")
    assert env.headline.heldout_rate == "legal_move_rate"
    with pytest.raises(ValueError, match=r"headline 'solved' counts outcomes \['solved'\]"):
        replace(env, headline=Headline("solved", ("solved", "win")))


def test_another_agent_drops_what_describes_the_environments_own_agent():
    gsm = load_environment("gsm")
    assert gsm.episode_metrics is not None and gsm.perturbations
    other = resolve_environment("gsm", "rlsys.envs.tictactoe.agent:agent", None)
    assert other.name == "gsm+plugins" and other.reward is gsm.reward
    # gsm's episode metrics read its agent's records (its calculations): another agent's records have none
    assert other.episode_metrics is None and other.perturbations == {} and other.first_request is None


def test_a_reward_file_brings_its_labels_validation_and_summaries_and_keeps_the_environments_items(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent("""
        OUTCOMES = ("miss", "hit")

        def reward(record):
            return 1.0 if outcome(record) == "hit" else 0.0

        def outcome(record):
            return "hit" if record["output"] == "5" else "miss"

        def validate_item(item):
            if "board" not in item:
                raise ValueError("no board")

        def summarize(outcomes):
            return {"hit_rate": outcomes.count("hit") / len(outcomes)}

        def summarize_by_kind(items, outcomes):
            return {"first_board_hit": float(outcomes[0] == "hit")}
    """))
    base = load_environment("tictactoe")
    env = resolve_environment("tictactoe", None, str(path))
    assert env.name == "tictactoe+plugins" and env.agent is base.agent
    assert env.outcomes == ("miss", "hit") and env.outcome({"output": "5"}) == "hit"
    assert env.reward({"output": "4"}) == 0.0
    with pytest.raises(ValueError, match="no board"):
        env.validate_item({})
    assert env.rates([{}, {}], ["hit", "failed"]) == {"hit_rate": 0.5, "first_board_hit": 1.0}
    assert env.train_items is base.train_items and env.perturbations == base.perturbations


def test_a_bare_reward_file_has_no_labels_or_summary_and_another_agent_drops_the_perturbations(tmp_path):
    reward = tmp_path / "bare_reward.py"
    reward.write_text("def reward(record):\n    return 0.5\n")
    agent = tmp_path / "my_agent.py"
    agent.write_text("async def run(item, client, model):\n    return None\n")
    env = EnvConfig(agent_fn=f"{agent}:run", reward_fn_path=str(reward)).environment()
    assert env.outcome is None and env.outcomes == () and env.validate_item is None and env.summarize is None
    assert env.perturbations == {} and asyncio.run(env.agent({}, None, "m")) is None


def test_a_broken_plugin_is_refused_as_before(tmp_path):
    sync = tmp_path / "sync_agent.py"
    sync.write_text("def agent(item, client, model):\n    return None\n")
    with pytest.raises(PluginError, match="must be `async def agent"):
        EnvConfig(agent_fn=str(sync)).environment()
    with pytest.raises(PluginError, match="no module named 'no_such_pkg'"):
        EnvConfig(reward_fn_path="no_such_pkg.mod:reward").environment()


# --- the framework names no environment -------------------------------------------------------------------------
# jobs/play.py (and its page) is the browser game against a checkpoint: tic-tac-toe by design, not framework code
NAMES_AN_ENV_BY_DESIGN = {"jobs/play.py", "jobs/static/play.html"}
ENV_NAME = re.compile(r"tic-?tac-?toe|tictactoe", re.I)
# file and folder names (configs/tictactoe-tiny-gspo.toml as a default or an example, runs/tictactoe-tiny) are
# paths to data, not code that knows the environment
PATH = re.compile(r"[\w.-]*/[\w./-]*|[\w.-]+\.toml")


def env_names(text: str) -> list[str]:
    """Lines of ``text`` that name an environment outside a path."""
    return [line.strip() for line in text.splitlines() if ENV_NAME.search(PATH.sub("", line))]


def test_the_name_check_finds_names_in_code_and_prose_but_not_in_paths():
    assert env_names("from rlsys.envs.tictactoe import game\nthe tic-tac-toe prompts\nTICTACTOE = 1") == [
        "from rlsys.envs.tictactoe import game", "the tic-tac-toe prompts", "TICTACTOE = 1"]
    assert env_names('default="configs/tictactoe-tiny-gspo.toml"\nrun_dir = "runs/tictactoe-tiny"') == []


def test_jobs_cli_and_report_name_no_environment():
    files = [p for p in (REPO / "jobs").rglob("*") if p.is_file() and p.suffix in (".py", ".html")]
    files += [REPO / "rlsys/cli.py", REPO / "rlsys/report.py"]
    found = [f"{p.relative_to(REPO)}: {line}" for p in files if str(p.relative_to(REPO)) not in NAMES_AN_ENV_BY_DESIGN
             for line in env_names(p.read_text())]
    assert found == [], "environment names in framework code:\n" + "\n".join(found)


def test_the_default_environment_is_named_in_one_place():
    from rlsys.envs.base import DEFAULT_ENV

    assert EnvConfig().name == DEFAULT_ENV == "tictactoe"


def test_importing_rlsys_and_its_environment_interface_loads_no_ray_vllm_or_environment():
    code = ("import sys, rlsys, rlsys.envs, rlsys.envs.base, rlsys.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm') "
            "or m.startswith('rlsys.envs.tictactoe')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


# --- tools that need an environment's prompts -------------------------------------------------------------------
def test_tune_measures_prompts_of_a_single_request_environment_only():
    from transformers import AutoTokenizer

    from jobs.items import first_prompts
    from jobs.tune import measured_prompt_tokens
    from rlsys.config import load_config
    from rlsys.models.tiny import ensure_tiny_model

    model = str(ensure_tiny_model())
    cfg = load_config(overrides=["data.num_items=16"])
    env = cfg.env.environment()
    expected = max(map(len, first_prompts(env, env.train_items(cfg.data), AutoTokenizer.from_pretrained(model))))
    assert measured_prompt_tokens(cfg, model) == expected > 50
    assert measured_prompt_tokens(load_config(overrides=["env.name=gsm"]), model) is None  # multi-turn: unknown
    other_agent = load_config(overrides=[f"env.agent_fn='{Path(__file__).resolve()}:_agent'"])
    assert measured_prompt_tokens(other_agent, model) is None


def test_rlsys_dataset_writes_the_named_environments_items_and_refuses_one_without_a_writer(tmp_path, capsys):
    import json as _json

    from rlsys.cli import main

    assert main(["dataset", "--count", "3", "--seed", "1", "--out", str(tmp_path / "boards.jsonl")]) == 0
    boards = [_json.loads(line) for line in (tmp_path / "boards.jsonl").read_text().splitlines()]
    assert len(boards) == 3 and all(len(b["board"]) == 9 for b in boards)  # the default environment's
    assert main(["dataset", "--env", "ledger", "--count", "2", "--seed", "0", "--split", "train",
                 "--out", str(tmp_path / "ledger.jsonl")]) == 0
    ledger = load_environment("ledger")
    for line in (tmp_path / "ledger.jsonl").read_text().splitlines():
        ledger.validate_item(_json.loads(line))
    capsys.readouterr()
    assert main(["dataset", "--env=gsm"]) == 2 and "gsm environment has no dataset writer" in capsys.readouterr().err
    assert main(["dataset", "--env", "chess"]) == 2 and "not a built-in environment" in capsys.readouterr().err
