"""`rlsys report`: summary numbers from a synthetic run directory, PNG plots, and clear refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlsys.plots import write_plots
from rlsys.report import load_run, main, summarize_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(root: Path, steps: int = 24, with_eval: bool = True, torn_tail: bool = False) -> Path:
    """A run directory as `rlsys train` writes it: rewards climb from -1.0 by 0.05 a step, occupied squares give
    way to optimal moves, the canary logp diff is a string "nan" at one step (as MetricsLogger writes it)."""
    root.mkdir(parents=True)
    lines = []
    for step in range(steps):
        reward = -1.0 + 0.05 * step
        occupied = max(0.0, 1.0 - step / 20)
        lines.append(json.dumps({
            "step": step, "rollout/rewards_mean": reward, "rollout/rewards_std": 0.2, "rollout/rewards_min": reward - 0.5,
            "rollout/rewards_max": reward + 0.5, "rollout/response_len_mean": 20.0 + step,
            "error/occupied": occupied, "error/optimal": 1.0 - occupied, "error/no_tool_call": 0.0,
            "train/loss": 0.1, "train/logp_diff_mean": "nan" if step == 3 else 1e-7 * (step + 1),
            "time/rollout": 2.0, "time/train": 1.0, "time/sync": 0.5, "time/step": 4.0, "perf/tokens_per_s": 100.0,
            "train/entropy": 1.0 - 0.02 * step,
        }))
    text = "\n".join(lines) + "\n" + ('{"step": 24, "rollout/rew' if torn_tail else "")
    (root / "metrics.jsonl").write_text(text)
    (root / "config.resolved.toml").write_text('[algo]\nname = "gspo"\n[model]\nckpt = "rlsys:tiny"\n')
    if with_eval:
        (root / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
            {"step": 0, "tag": "start", "eval/rewards_mean": -0.9, "eval/legal_move_rate": 0.1, "eval/valid_call_rate": 1.0},
            {"step": steps, "tag": "end", "eval/rewards_mean": 0.2, "eval/legal_move_rate": 0.7, "eval/valid_call_rate": 1.0,
             "eval/win_taken_rate": 0.9, "eval/block_rate": 0.5, "eval/other_optimal_rate": 0.25, "eval/win_episodes": 160},
        ]))
    return root


def test_summary_numbers(tmp_path):
    s = summarize_run(load_run(make_run(tmp_path / "run")), window=10)
    assert (s["steps"], s["first_step"], s["last_step"], s["algo"]) == (24, 1, 24, "gspo")
    r = s["reward"]
    assert r["best"] == pytest.approx(0.15) and r["best_step"] == 24 and r["last"] == pytest.approx(0.15)
    assert r["first_window_mean"] == pytest.approx(-1.0 + 0.05 * 4.5)  # steps 0..9
    assert r["last_window_mean"] == pytest.approx(-1.0 + 0.05 * 18.5)  # steps 14..23
    assert s["errors"]["occupied"]["first"] == pytest.approx(sum(1 - k / 20 for k in range(10)) / 10)
    assert s["errors"]["occupied"]["last"] == pytest.approx(sum(max(0, 1 - k / 20) for k in range(14, 24)) / 10)
    assert s["time_mean_s"] == {"rollout": 2.0, "train": 1.0, "sync": 0.5, "step": 4.0}
    # the "nan" string is read back as a float and left out of the mean, not a crash
    assert s["means"]["train/logp_diff_mean"] == pytest.approx(sum(1e-7 * (k + 1) for k in range(24) if k != 3) / 23)
    assert [e["tag"] for e in s["evals"]] == ["start", "end"] and s["evals"][1]["legal_move_rate"] == 0.7
    assert (s["evals"][1]["win_taken_rate"], s["evals"][1]["block_rate"]) == (0.9, 0.5)
    assert "win_taken_rate" not in s["evals"][0]  # an eval from before the split has none
    assert s["means"]["train/entropy"] == pytest.approx(1.0 - 0.02 * 11.5) and s["lasts"]["train/entropy"] == pytest.approx(0.54)


def test_a_gzipped_run_as_docs_data_keeps_it_reads_the_same(tmp_path, capsys):
    import gzip

    plain = make_run(tmp_path / "plain")
    packed = make_run(tmp_path / "packed")
    for name in ("metrics.jsonl", "eval.jsonl"):  # as docs/data/ lands them: gzipped, the plain file gone
        f = packed / name
        (packed / f"{name}.gz").write_bytes(gzip.compress(f.read_bytes()))
        f.unlink()
    assert summarize_run(load_run(packed), window=10) == {**summarize_run(load_run(plain), window=10), "run_dir": str(packed)}
    (packed / "eval.jsonl.gz").write_bytes(b"not gzip")  # a broken copy: one line naming the file, exit 2
    assert main([str(packed), "--no-plots"]) == 2
    assert "eval.jsonl.gz: not a readable gzip file" in capsys.readouterr().err


def test_printed_report_and_plots(tmp_path, capsys):
    run = make_run(tmp_path / "run", torn_tail=True)  # a torn last line (a run killed mid-write) is skipped
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    for needle in ("24 steps logged", "best 0.150 (step 24)", "occupied", "time per step, mean (s): 4.00",
                   "rollout         2.000 (50%)", "after step 24 [end]", "legal_move_rate 0.700",
                   "legal_move_rate 0.700  valid_call_rate 1.000  win_taken_rate 0.900  block_rate 0.500  "
                   "other_optimal_rate 0.250",
                   "entropy      mean 0.7700, last 0.5400"):
        assert needle in out, needle
    for name in ("reward.png", "response_len.png", "loss.png", "logp_diff.png", "entropy.png", "step_time.png",
                 "errors.png"):
        png = run / "plots" / name
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert png.stat().st_size > 5_000, f"{name} looks empty"


def test_sft_run_without_logp_diff_skips_that_plot_and_says_so(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    (run / "config.resolved.toml").write_text('[algo]\nname = "sft"\n')
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "train/loss": 1.0 / (k + 1), "time/step": 1.0,
                                                           "rollout/response_len_mean": 20.0}) + "\n" for k in range(5)))
    written, skipped = write_plots(load_run(run))
    assert {p.name for p in written} == {"response_len.png", "loss.png", "step_time.png"}
    assert any(s.startswith("logp_diff.png") for s in skipped) and "reward.png: SFT has no reward" in skipped
    assert summarize_run(load_run(run))["algo"] == "sft" and "reward" not in summarize_run(load_run(run))


def test_not_a_run_directory_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlsys report:") and "no metrics.jsonl" in err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    assert main([str(tmp_path), "--no-plots"]) == 2
    assert "metrics.jsonl:2: not JSON" in capsys.readouterr().err


def test_failure_lines_name_the_most_common_reasons_of_a_step():
    from rlsys.metrics import failure_lines
    from rlsys.types import TrajectorySummary

    def summary(reason: str | None) -> TrajectorySummary:
        return TrajectorySummary(item_id="b", group=0, sample=0, reward=0.0, outcome="", failed=reason is not None,
                                 fail_reason=reason or "", response_len=5, num_turns=1, segment_breaks=0)

    reasons = ["agent_error: APIConnectionError"] * 3 + ["reward_timeout: 30 s"] * 2 + ["a", "b"]
    lines = failure_lines([summary(r) for r in reasons] + [summary(None)] * 4, limit=2)
    assert lines == ["  3 failed: agent_error: APIConnectionError", "  2 failed: reward_timeout: 30 s",
                     "  ... and 2 more (2 other reasons)"]
    assert failure_lines([summary(None)]) == []


def test_several_runs_make_one_table_a_row_each_and_their_mean(tmp_path, capsys):
    from rlsys.report import compare_runs

    a, b = make_run(tmp_path / "seed0"), make_run(tmp_path / "seed1", steps=30)
    # seed1: its last 5 steps skipped their update (dynamic sampling kept no group), and it was evaluated under two
    # prompt perturbations at the end
    rows = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    for r in rows[-5:]:
        del r["train/loss"], r["train/entropy"]
        r["train/skipped_batch"] = 1.0
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [json.loads(line) for line in (b / "eval.jsonl").read_text().splitlines()]
    evals[-1] |= {"eval/grid_alt/rewards_mean": 0.1, "eval/terse/rewards_mean": 0.3, "eval/error/occupied": 0.2}
    (b / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))

    ra, rb = compare_runs([load_run(a), load_run(b)], window=10)
    assert (ra["run"], ra["steps"], ra["updates"]) == ("seed0", 24, 24)
    assert (rb["steps"], rb["updates"]) == (30, 25)
    # a step whose optimizer step was skipped for a non-finite gradient logs a loss but moved nothing
    opt = 0.0
    for i, r in enumerate(rows[:-5]):
        bad = i in (3, 7)
        opt += 0.0 if bad else 1.0
        r |= {"train/optimizer_steps": opt, "train/skipped_steps": float(bad)}
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compare_runs([load_run(b)], window=10)[0]["updates"] == 23
    for r in rows:  # older logs: no optimizer_steps, the skipped count alone
        r.pop("train/optimizer_steps", None)
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compare_runs([load_run(b)], window=10)[0]["updates"] == 23
    assert ra["reward"][0] == pytest.approx(-1.0 + 0.05 * 4.5) and ra["reward"][1] == pytest.approx(-1.0 + 0.05 * 18.5)
    assert rb["entropy"][1] == pytest.approx(_mean_of(1.0 - 0.02 * k for k in range(20, 25)))  # the updates of the window
    assert ra["heldout"]["legal_move_rate"] == (0.1, 0.7) and ra["heldout"]["win_taken_rate"] == (None, 0.9)
    assert "win_episodes" not in ra["heldout"] and ra["perturbed_reward"] is None
    assert rb["perturbed_reward"] == (0.1, 0.3)  # the perturbations' mean rewards, not the error table's rates
    assert ra["step_s_median"] == 4.0 and ra["eval_steps"] == (0, 24)
    assert ra["wall_s"] is None  # no start-up logged: no estimate
    rows[0]["startup/job_ready_s"] = 60.0
    evals[0]["time/eval"], evals[-1]["time/eval"] = 10.0, 20.0
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (b / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    rb = compare_runs([load_run(b)], window=10)[0]
    assert rb["wall_s"] == pytest.approx(60.0 + 30 * 4.0 + 10.0 + 20.0)  # start-up + steps + evals

    assert main([str(a), str(b), "--window", "10", "--mean", "--rates", "legal_move_rate,rewards_mean"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| run | steps | with an update | reward first -> last 10 |") and "| wall min |" in out[0]
    assert out[0].rstrip().endswith("| held-out legal_move | held-out rewards_mean | perturbed reward, end |")
    assert out[2].startswith("| seed0 | 24 | 24 | -0.775 -> -0.075 |") and "| 0.100 -> 0.700 | -0.900 -> 0.200 |" in out[2]
    assert out[3].endswith("| 0.100-0.300 |") and "| 4.00 | 3.5 |" in out[3]  # median step, wall minutes
    assert out[4].startswith("| mean of 2 | 27 | 24 |") and out[4].endswith("| 0.100-0.300 |")
    assert not (a / "plots").exists()  # several runs: the table only

    assert main([str(a), str(b), "--rates", "legal_move_rate,optimal_rate"]) == 2
    assert "--rates: no run has optimal_rate" in capsys.readouterr().err
    assert main([str(a), str(tmp_path / "missing")]) == 2
    assert "missing: no metrics.jsonl" in capsys.readouterr().err


def _mean_of(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


def test_plot_of_several_runs_is_one_png_and_refused_for_one(tmp_path, capsys):
    from rlsys.report import moving_mean

    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    a, b = make_run(tmp_path / "lora0"), make_run(tmp_path / "full1", steps=30)
    png = tmp_path / "img" / "compare.png"
    assert main([str(a), str(b), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC and "curves in" in capsys.readouterr().err
    assert not (a / "plots").exists()
    with pytest.raises(SystemExit) as exit_info:  # argparse's refusal: one run's plots have their own place
        main([str(a), "--plot", str(png)])
    assert exit_info.value.code == 2 and "--plot compares several runs" in capsys.readouterr().err


def test_line_styles_tell_seeds_apart_by_colour_alone_or_by_style_within_a_variant():
    from rlsys.plots import line_styles

    assert line_styles(["gsm0", "gsm1", "gsm2"]) == [("C0", "-"), ("C1", "-"), ("C2", "-")]
    assert line_styles(["lora0", "full0", "lora1", "full_seed1", "lora2"]) == [
        ("C0", "-"), ("C1", "-"), ("C0", "--"), ("C1", "--"), ("C0", ":")]


def test_entropy_over_the_top_entropy_tokens_is_labelled_as_such(tmp_path, capsys):
    """With `algo.top_entropy_frac` the logged entropy is the selected tokens' mean (several times the all-token
    mean): the summary, the table and the entropy plot say so, and a run without it is not marked."""
    from rlsys.report import compare_runs, format_comparison, format_summary

    top, plain = make_run(tmp_path / "top0"), make_run(tmp_path / "plain0")
    (top / "config.resolved.toml").write_text('[algo]\nname = "gspo"\ntop_entropy_frac = 0.2\n')
    text = format_summary(summarize_run(load_run(top), window=10))
    assert "entropy      mean 0.7700, last 0.5400 (the top 0.2 of the sampled tokens: algo.top_entropy_frac)" in text
    assert "top 0.2" not in format_summary(summarize_run(load_run(plain), window=10))
    rows = compare_runs([load_run(top), load_run(plain)], window=10)
    table = format_comparison(rows, window=10).splitlines()
    assert "| 0.910 -> 0.630 (top 0.2) |" in table[2] and "(top" not in table[3]
    png = tmp_path / "compare.png"
    assert main([str(top), str(plain), "--plot", str(png)]) == 0 and png.read_bytes()[:8] == PNG_MAGIC
    written, _ = write_plots(load_run(top), tmp_path / "plots")
    assert any(p.name == "entropy.png" for p in written)


def test_the_environments_episode_metrics_are_summed_up_first_against_last_window(tmp_path):
    """`episode/<name>` (tic-tac-toe: the rates by kind of board) shows as first -> last window means; a step
    without episodes of a kind logs no key and is left out of that mean."""
    from rlsys.report import format_summary

    run = make_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["episode/win_taken"] = r["step"] / 23
        if r["step"] != 22:
            r["episode/block"] = 0.5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize_run(load_run(run), window=10)
    assert s["episode"]["win_taken"] == (pytest.approx(4.5 / 23), pytest.approx(18.5 / 23))
    assert s["episode"]["block"] == (0.5, 0.5)
    text = format_summary(s)
    assert "per episode (the environment's episode_metrics), mean first 10 -> last 10" in text
    assert "    win_taken                               0.196     0.804" in text
    assert "per episode" not in format_summary(summarize_run(load_run(make_run(tmp_path / "plain")), window=10))


def test_dynamic_sampling_is_summed_up_and_a_short_batch_gets_a_hint(tmp_path):
    """`algo.dynamic_sampling`'s counters: boards sampled, the share with signal, rounds, groups kept, and the steps
    that trained on fewer than `rollout.batch_size` groups (the rounds cap hit first); over a quarter of the last
    window short prints what to raise. A run without the filter has no such block."""
    from rlsys.report import compare_runs, format_comparison, format_summary

    run = make_run(tmp_path / "run")
    config = ('[algo]\nname = "gspo"\ndynamic_sampling = true\nmax_sample_rounds = 3\nmax_oversample = 8.0\n'
              '[rollout]\nbatch_size = 4\n[model]\nckpt = "rlsys:tiny"\n')
    (run / "config.resolved.toml").write_text(config)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        late = r["step"] >= 14
        r.update({"rollout/groups_sampled": 60.0 if late else 8.0, "rollout/zero_var_group_frac": 0.95 if late else 0.5,
                  "rollout/sample_rounds": 3.0 if late else 1.0,
                  "rollout/groups_kept": (3.0 if r["step"] % 2 else 4.0) if late else 4.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize_run(load_run(run), window=10)["sampling"]
    assert (s["batch_size"], s["max_sample_rounds"], s["max_oversample"]) == (4, 3, 8.0)
    assert s["first"] == {"boards_sampled": 8.0, "signal_frac": 0.5, "groups_kept": 4.0, "rounds": 1.0,
                          "short_frac": 0.0, "at_cap_frac": 0.0}
    last = s["last"]
    assert last["boards_sampled"] == 60.0 and last["signal_frac"] == pytest.approx(0.05)
    assert (last["groups_kept"], last["short_frac"], last["at_cap_frac"]) == (3.5, 0.5, 1.0)
    text = format_summary(summarize_run(load_run(run), window=10))
    assert "    groups with signal kept (of 4)           4.00      3.50" in text
    assert "-> 50% of the last 10 steps trained on fewer groups with signal than rollout.batch_size" in text
    assert "Larger caps (algo.max_oversample, now 8.0; max_sample_rounds)" in text and "algo.unanimous_groups" in text
    for r in rows:  # every step full: the numbers, no hint
        r["rollout/groups_kept"] = 4.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "Larger caps" not in format_summary(summarize_run(load_run(run), window=10))
    plain = summarize_run(load_run(make_run(tmp_path / "plain")), window=10)
    assert plain["sampling"] is None and "dynamic sampling" not in format_summary(plain)
    # several runs: a column of the last window's groups with signal, "-" for a run without the filter
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "rollout/groups_kept": 3.0 if r["step"] >= 14 else 4.0})
                                               + "\n" for r in rows))
    table = format_comparison(compare_runs([load_run(run), load_run(tmp_path / "plain")], window=10), 10,
                              mean=True).splitlines()
    assert "| zero-var first -> last | groups with signal, last 10 | entropy first -> last |" in table[0]
    assert "| 0.50 -> 0.95 | 3.00 | 0.910 -> 0.630 |" in table[2]
    assert "| - -> - | - | 0.910 -> 0.630 |" in table[3]  # the run without the filter
    assert "| 0.50 -> 0.95 | 3.00 |" in table[4]  # the mean row: over the runs that have a number
    assert "groups with signal" not in format_comparison(compare_runs([load_run(tmp_path / "plain")], 10), 10)
    # the filter off: the counters are logged all the same (every group kept), but there is nothing to sum up
    (run / "config.resolved.toml").write_text(config.replace("dynamic_sampling = true", "dynamic_sampling = false"))
    assert summarize_run(load_run(run), window=10)["sampling"] is None
    # no config beside the metrics (a copied run): a step that sampled twice tells the filter was on
    (run / "config.resolved.toml").unlink()
    assert summarize_run(load_run(run), window=10)["sampling"]["last"]["rounds"] == 3.0
    for r in rows:
        r["rollout/sample_rounds"] = 1.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summarize_run(load_run(run), window=10)["sampling"] is None


def test_the_collapse_check_is_replayed_on_the_logged_steps_with_the_runs_own_settings(tmp_path):
    """The report reads the collapse as the job would (rlsys/collapse.py): the run's `algo.collapse_steps` and
    `algo.collapse_share`, or the defaults (20, 0.8) where its config predates them; a run that never collapsed
    says how far it was from it; SFT has no groups and no such line."""
    from rlsys.report import format_summary

    run = make_run(tmp_path / "run", steps=60)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    pattern = "." * 10 + "U.UUUUUUUU" * 5  # from step 11: 9 of every 10 steps unanimous, never 20 in a row
    for r, c in zip(rows, pattern):
        r["rollout/zero_var_group_frac"] = 1.0 if c == "U" else 0.75
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = summarize_run(load_run(run))["collapse"]
    # the defaults, 32 of the last 40: the first full window that holds 32
    windows = [sum(ch == "U" for ch in pattern[max(0, k - 40):k]) for k in range(40, 61)]
    assert c["declared_step"] == 40 + next(i for i, w in enumerate(windows) if w >= 32)
    assert (c["how"], c["longest"], c["unanimous"], c["steps"], c["need"]) == ("share", 9, 45, 60, 32)
    assert f"COLLAPSED at step {c['declared_step']} (32 of the last 40; 45 of 60 steps" in format_summary(
        summarize_run(load_run(run)))
    # the run's own settings: a share of 1.0 leaves only the streak, which never reaches 20
    (run / "config.resolved.toml").write_text('[algo]\nname = "gspo"\ncollapse_steps = 20\ncollapse_share = 1.0\n')
    c = summarize_run(load_run(run))["collapse"]
    assert c["declared_step"] is None and c["most"] == max(windows)
    assert ("collapse check: not declared (45 of 60 steps had every group unanimous; longest streak 9, most in 40 "
            f"steps {max(windows)}; it needs 20 in a row or 40 of 40") in format_summary(summarize_run(load_run(run)))
    (run / "config.resolved.toml").write_text('[algo]\nname = "gspo"\ncollapse_steps = 4\n')  # 4 in a row
    assert summarize_run(load_run(run))["collapse"]["declared_step"] == 16  # steps 13-16: the first four in a row
    # several runs: the steps cell says where the check declared it, a run that never collapsed says nothing
    from rlsys.report import compare_runs, format_comparison

    plain_dir = make_run(tmp_path / "plain")
    rows = compare_runs([load_run(run), load_run(plain_dir)], window=10)
    assert [r["collapsed_at"] for r in rows] == [16, None]
    table = format_comparison(rows, 10).splitlines()
    assert table[2].startswith("| run | 60 (collapsed at 16) | ") and table[3].startswith("| plain | 24 | ")
    (run / "config.resolved.toml").write_text('[algo]\nname = "sft"\n')
    assert summarize_run(load_run(run))["collapse"] is None
    assert compare_runs([load_run(run)], window=10)[0]["collapsed_at"] is None
    plain = summarize_run(load_run(plain_dir))  # no zero-variance fraction logged
    assert plain["collapse"] is None and "collapse check" not in format_summary(plain)


def test_plots_dir_leaves_the_run_directory_untouched(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    out = tmp_path / "elsewhere" / "plots"
    assert main([str(run), "--plots-dir", str(out)]) == 0
    assert f"plots in {out}/" in capsys.readouterr().out
    assert not (run / "plots").exists()
    assert (out / "reward.png").read_bytes()[:8] == PNG_MAGIC
    for argv in ([str(run), str(run), "--plots-dir", str(out)], [str(run), "--no-plots", "--plots-dir", str(out)]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
