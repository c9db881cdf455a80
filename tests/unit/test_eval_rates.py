"""jobs/eval.py's held-out rates without Ray: the environment's rates, failed episodes, the printed table."""
from __future__ import annotations

from rlsys.types import TrajectorySummary

WIN, BLOCK, OTHER = "XX.OO....", "X....XOO.", "XO......."


def _summary(outcome: str, failed: bool = False) -> TrajectorySummary:
    return TrajectorySummary(item_id="b", group=0, sample=0, reward=0.0, outcome=outcome, failed=failed,
                             fail_reason="agent_error" if failed else "", response_len=5, num_turns=1,
                             segment_breaks=0)


def test_outcome_rates_give_totals_and_kinds_and_count_failures_as_misses():
    from jobs.eval import outcome_rates
    from rlsys.envs.tictactoe.env import ENV

    items = [{"board": b} for b in (WIN, WIN, BLOCK, OTHER)]
    # a failed episode whose outcome still says "win" (the agent raised after the call): a miss everywhere
    summaries = [_summary("win"), _summary("win", failed=True), _summary("optimal"), _summary("legal_suboptimal")]
    m = outcome_rates(ENV, items, summaries)
    assert m["win_move_rate"] == 0.25 and m["optimal_move_rate"] == 0.5 and m["legal_move_rate"] == 0.75
    assert m["win_taken_rate"] == 0.5 and m["win_episodes"] == 2.0
    assert m["block_rate"] == 1.0 and m["other_optimal_rate"] == 0.0 and m["lost_episodes"] == 0.0
    assert "lost_legal_rate" not in m


def test_outcome_rates_of_an_environment_without_a_summary_are_empty():
    import dataclasses

    from jobs.eval import outcome_rates
    from rlsys.envs.tictactoe.env import ENV

    bare = dataclasses.replace(ENV, summarize=None)
    assert outcome_rates(bare, [{"board": WIN}], [_summary("win")]) == {}
    totals_only = dataclasses.replace(ENV, summarize=lambda items, outcomes: {"solved_rate": 1.0})
    assert outcome_rates(totals_only, [{}], [_summary("solved")]) == {"solved_rate": 1.0}


def test_format_table_prints_the_rates_in_the_environments_order_and_the_kinds_counted():
    from jobs.eval import format_table

    variant = {"episodes": 4, "valid_call_rate": 1.0, "legal_move_rate": 0.75, "optimal_move_rate": 0.5,
               "win_move_rate": 0.25, "win_taken_rate": 0.5, "block_rate": 1.0, "other_optimal_rate": 0.0,
               "win_episodes": 2.0, "block_episodes": 1.0, "lost_episodes": 0.0, "other_episodes": 1.0,
               "rewards_mean": 0.4, "failed_frac": 0.25, "errors": {"win": 0.25, "agent_error": 0.25, "occupied": 0.5}}
    report = {"model_path": "m", "num_items": 4, "items": "b", "samples": 1, "temperature": 0.0, "env": "tictactoe",
              "outcomes": ["no_tool_call", "occupied", "win"], "time_s": {"episodes": 1.0},
              "variants": {"default": variant}}
    lines = format_table(report).splitlines()
    assert "4 items from b; by kind: win 2, block 1, lost 0, other 1" in lines[1]
    rows = [line.split()[0] for line in lines[5:]]
    assert rows[:9] == ["valid_call_rate", "legal_move_rate", "optimal_move_rate", "win_move_rate", "win_taken_rate",
                        "block_rate", "other_optimal_rate", "rewards_mean", "failed_frac"]
    assert rows[-3:] == ["occupied", "win", "agent_error"]  # the environment's order, failures after
    assert not any("_episodes" in row for row in rows)


def test_episode_metrics_are_averaged_over_valid_episodes_and_reported_per_variant():
    from jobs.eval import VariantResult, format_table
    from rlsys.metrics import rollout_metrics

    summaries = [_summary("right"), _summary("wrong"), _summary("wrong", failed=True), _summary("no_answer")]
    summaries[0].metrics = {"used_calculator": 1.0, "calculator_calls": 3.0}
    summaries[1].metrics = {"used_calculator": 0.0, "calculator_calls": 0.0}
    summaries[2].metrics = {"used_calculator": 1.0, "calculator_calls": 9.0}  # failed: not counted
    summaries[3].metrics = {"used_calculator": 1.0}  # an episode may report fewer keys
    m = rollout_metrics(summaries, ("right", "wrong"))
    assert m["episode/used_calculator"] == 2 / 3 and m["episode/calculator_calls"] == 1.5
    report = VariantResult(episodes=4, rollout=m, rates={"accuracy": 0.25}).report()
    assert report["episode"] == {"calculator_calls": 1.5, "used_calculator": 2 / 3}
    table = format_table({"model_path": "m", "num_items": 4, "items": "q", "samples": 1, "temperature": 0.0,
                          "env": "gsm", "outcomes": ["wrong", "right"], "time_s": {"episodes": 1.0},
                          "variants": {"default": report}})
    rows = [line.split()[0] for line in table.splitlines()[5:]]
    assert rows[:3] == ["accuracy", "rewards_mean", "failed_frac"]
    assert rows[3:6] == ["per", "calculator_calls", "used_calculator"]
    assert "episode/used_calculator" not in rollout_metrics([_summary("right")])


def test_the_gsm_environment_reports_its_calculator_use_per_episode():
    from rlsys.envs.gsm.env import ENV

    calc = {"content": None, "finish_reason": "tool_calls", "tool_call_errors": [], "tool_calls": [
        {"id": "c", "name": "calculate", "arguments": '{"expression": "3 * 4"}'}]}
    item = {"id": "q", "split": "heldout", "template": 0, "seed": 1, "question": "?", "answer": 12}
    record = {"item": item, "output": {"turns": [calc]}}
    assert ENV.episode_metrics(record) == {"calculator_calls": 1.0, "calculator_errors": 0.0, "used_calculator": 1.0,
                                           "right_with_calculator": 0.0}  # no answer yet: not right
