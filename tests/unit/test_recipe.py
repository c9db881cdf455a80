"""Recipes (jobs/recipe.py): parsing, per-stage configs and chaining, the summary table and plot, without Ray."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jobs.recipe import (final_checkpoint, format_summary, main, plot_curves, read_recipe, resolve_stages, summarize,
                         write_summary)
from rlsys.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_recipe(tmp_path: Path, body: str) -> Path:
    (tmp_path / "sft.toml").write_text('max_steps = 7\n[algo]\nname = "sft"\n[learner]\nlr = 3e-3\n')
    (tmp_path / "gspo.toml").write_text('max_steps = 11\n[rollout]\nbatch_size = 2\nn_samples = 4\n')
    path = tmp_path / "recipe.toml"
    path.write_text(body)
    return path


TWO_STAGES = """
seed = 5
[[stages]]
name = "sft"
config = "sft.toml"
overrides = ["learner.warmup_steps=2"]
[stages.set]
learner = { lr = 1e-3 }

[[stages]]
name = "gspo"
config = "gspo.toml"
"""


def test_stages_chain_checkpoints_and_take_overrides_in_order(tmp_path):
    recipe = read_recipe(write_recipe(tmp_path, TWO_STAGES))
    assert [s.name for s in recipe.stages] == ["sft", "gspo"] and recipe.report == "gspo" and recipe.seed == 5
    cfgs = resolve_stages(recipe, tmp_path / "run", "ns", ["gspo:max_steps=3", "learner.mini_bs=2"])
    sft, gspo = cfgs
    # file < set < overrides; the recipe's seed, run_dir and namespace win over the stage's own
    assert (sft.max_steps, sft.learner.lr, sft.learner.warmup_steps, sft.seed) == (7, 1e-3, 2, 5)
    assert sft.run_dir == str(tmp_path / "run" / "sft") and sft.cluster.namespace == "ns"
    assert sft.model.ckpt == "rlsys:tiny"  # the first stage is not chained
    # the second stage starts from the first one's final checkpoint; STAGE:KEY=VALUE reaches only that stage
    assert gspo.model.ckpt == str(final_checkpoint(sft)) == str(tmp_path / "run" / "sft" / "checkpoints" / "step_000007")
    assert (gspo.max_steps, gspo.rollout.batch_size, gspo.seed) == (3, 2, 5)
    assert sft.learner.mini_bs == gspo.learner.mini_bs == 2  # KEY=VALUE reaches every stage


def test_from_previous_false_keeps_the_stage_model(tmp_path):
    body = TWO_STAGES.replace('config = "gspo.toml"', 'config = "gspo.toml"\nfrom_previous = false')
    _, gspo = resolve_stages(read_recipe(write_recipe(tmp_path, body)), tmp_path / "run", "ns", [])
    assert gspo.model.ckpt == "rlsys:tiny"


@pytest.mark.parametrize("body, needle", [
    ("seed = 1\n", "needs at least one [[stages]]"),
    ("colour = 1\n[[stages]]\nname = 'a'\n", "unknown key(s) ['colour']"),
    ("[[stages]]\nname = 'a'\nlr = 1\n", "stages[0]: unknown key(s) ['lr']"),
    ("[[stages]]\nname = 'a/b'\n", "name must be a non-empty folder name"),
    ("[[stages]]\nname = 'a'\n[[stages]]\nname = 'a'\n", "stage names must be unique"),
    ("[[stages]]\nname = 'a'\nconfig = 'missing.toml'\n", "missing.toml not found"),
    ("report = 'b'\n[[stages]]\nname = 'a'\n", "report = 'b' names no stage"),
    ("[[stages]]\nname = 'a'\noverrides = [1]\n", "overrides must be a list of 'key=value' strings"),
    ("[[stages\n", "invalid TOML"),
])
def test_bad_recipes_name_what_is_wrong(tmp_path, body, needle):
    with pytest.raises(ConfigError, match="recipe") as err:
        read_recipe(write_recipe(tmp_path, body))
    assert needle in str(err.value)


def test_bad_stage_values_and_unknown_stage_prefixes_are_refused_before_anything_runs(tmp_path):
    recipe = read_recipe(write_recipe(tmp_path, TWO_STAGES))
    with pytest.raises(ConfigError, match="no stage named 'grpo'"):
        resolve_stages(recipe, tmp_path / "run", "ns", ["grpo:max_steps=3"])
    with pytest.raises(ConfigError, match=r"(?s)recipe stage 'gspo': .*learner.lr: Input should be greater than 0"):
        resolve_stages(recipe, tmp_path / "run", "ns", ["gspo:learner.lr=-1"])
    assert not (tmp_path / "run").exists()


def test_main_recipe_resolves(tmp_path):
    """The README's main job: SFT then GSPO, every stage valid, GSPO chained to the SFT checkpoint."""
    recipe = read_recipe(REPO / "configs" / "recipes" / "tictactoe-tiny.toml")
    sft, gspo = resolve_stages(recipe, tmp_path / "run", "ns", [])
    assert (sft.algo.name, gspo.algo.name) == ("sft", "gspo")
    assert gspo.model.ckpt == str(final_checkpoint(sft))
    assert gspo.eval.at_start and gspo.eval.at_end and gspo.data.num_items == 2048
    # time-boxed below the README's 15 minutes (the box counts from the command's start; the end eval and the summary
    # took ~6 s after it: 14 min 36 s wall for 14.5), with room for more steps than the box holds
    assert gspo.max_train_minutes <= 14.5 and gspo.max_steps >= 1000 and sft.max_train_minutes is None


def write_stage(root: Path, steps: int, evals: list[dict], temperature: float = 0.0) -> Path:
    """A GSPO stage directory: reward climbs by 0.01 a step, occupied squares give way to optimal moves."""
    root.mkdir(parents=True)
    rows = []
    for step in range(steps):
        occupied = 1.0 - step / steps
        rows.append({"step": step, "rollout/rewards_mean": -1.0 + 0.01 * step, "error/occupied": occupied,
                     "error/optimal": 0.5 * (1 - occupied), "error/win": 0.5 * (1 - occupied), "error/parse_error": 0.0})
    rows.insert(3, {"step": 2, "eval/legal_move_rate": 0.5})  # rows without a reward (evals) are not steps
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    (root / "config.resolved.toml").write_text(f"[eval]\ntemperature = {temperature}\n")
    return root


def test_summary_windows_and_held_out_before_after(tmp_path):
    evals = [{"step": 0, "tag": "start", "eval/legal_move_rate": 0.4, "eval/valid_call_rate": 1.0,
              "eval/optimal_move_rate": 0.2, "eval/num_trajectories": 256.0},
             {"step": 100, "tag": "end", "eval/legal_move_rate": 0.9, "eval/valid_call_rate": 1.0,
              "eval/optimal_move_rate": 0.6, "eval/num_trajectories": 256.0}]
    s = summarize(write_stage(tmp_path / "gspo", 100, evals), None, window=20)
    assert s["steps"] == 100 and s["window"] == 20
    first, last = s["curve"]["rewards_mean"]
    assert first == pytest.approx(-1.0 + 0.01 * 9.5) and last == pytest.approx(-1.0 + 0.01 * 89.5)
    assert s["curve"]["legal_move"][0] == pytest.approx(sum(k / 100 for k in range(20)) / 20)
    assert s["curve"]["error/occupied"][1] == pytest.approx(sum(1 - k / 100 for k in range(80, 100)) / 20)
    # the error table in the reward's order: worst outcome first, legal moves last
    assert [k for k in s["curve"] if k.startswith("error/")] == [
        "error/parse_error", "error/occupied", "error/optimal", "error/win"]
    assert s["held_out"]["legal_move_rate"] == (0.4, 0.9) and s["held_out"]["optimal_move_rate"] == (0.2, 0.6)
    text = format_summary(s)
    assert "held-out (256 episodes, greedy)" in text
    assert "  legal_move_rate                    0.400     0.900   +0.500" in text
    assert "first  20   last  20" in text


def test_before_falls_back_to_the_previous_stage_and_missing_evals_are_nan(tmp_path):
    previous = tmp_path / "sft"
    previous.mkdir()
    (previous / "eval.jsonl").write_text(json.dumps({"tag": "end", "eval/legal_move_rate": 0.3}) + "\n")
    s = summarize(write_stage(tmp_path / "gspo", 5, [], temperature=1.3), previous, window=20)
    assert s["window"] == 5
    before, after = s["held_out"]["legal_move_rate"]
    assert before == 0.3 and math.isnan(after)
    assert "T=1.3" in format_summary(s)


def test_summary_files_and_curves_png(tmp_path, capsys):
    evals = [{"tag": "start", "eval/legal_move_rate": 0.4}, {"tag": "end", "eval/legal_move_rate": 0.9}]
    stage = write_stage(tmp_path / "gspo", 30, evals)
    s = summarize(stage, None, window=10)
    s["time_s"] = {"ray_start": 3.0, "total": 100.0}
    write_summary(tmp_path, s)
    assert "wall time: ray_start 3 s, total 100 s" in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["held_out"]["legal_move_rate"] == [0.4, 0.9]
    assert (tmp_path / "summary.md").read_text().startswith("```\nRL curve (30 steps)")
    png = plot_curves(stage, tmp_path / "curves.png", s)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_the_summary_follows_the_environments_headline_rate(tmp_path):
    """gsm's headline is right answers (held out: right_rate); an environment without one gets the reward alone."""
    gsm = tmp_path / "gsm"
    gsm.mkdir()
    rows = [{"step": k, "rollout/rewards_mean": 0.0, "error/right": k / 10, "error/wrong": 1 - k / 10} for k in range(10)]
    (gsm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (gsm / "eval.jsonl").write_text(json.dumps({"tag": "start", "eval/right_rate": 0.04}) + "\n"
                                    + json.dumps({"tag": "end", "eval/right_rate": 0.2}) + "\n")
    (gsm / "config.resolved.toml").write_text('[env]\nname = "gsm"\n')
    s = summarize(gsm, None, window=5)
    assert s["headline"] == {"name": "right", "outcomes": ("right",), "heldout_rate": "right_rate"}
    assert s["curve"]["right"] == (pytest.approx(0.2), pytest.approx(0.7)) and "legal_move" not in s["curve"]
    assert s["held_out"]["right_rate"] == (0.04, 0.2)
    assert plot_curves(gsm, tmp_path / "gsm.png", s).read_bytes()[:8] == PNG_MAGIC

    (gsm / "config.resolved.toml").write_text('[env]\nname = "mcp_calculator"\n')
    s = summarize(gsm, None, window=5)
    assert s["headline"] is None and set(s["curve"]) == {"rewards_mean", "error/right", "error/wrong"}
    assert plot_curves(gsm, tmp_path / "plain.png").read_bytes()[:8] == PNG_MAGIC


def test_command_line_refuses_a_bad_recipe_with_exit_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlsys recipe: recipe") and "nope.toml: not found" in err
