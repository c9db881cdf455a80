"""jobs/eval.py's held-out rates without Ray: totals and rates by kind of board, failed episodes, the printed table."""
from __future__ import annotations

import types

import pytest

from rlsys.types import TrajectorySummary

WIN, BLOCK, OTHER = "XX.OO....", "X....XOO.", "XO......."


def _summary(outcome: str, failed: bool = False) -> TrajectorySummary:
    return TrajectorySummary(item_id="b", group=0, sample=0, reward=0.0, outcome=outcome, failed=failed,
                             fail_reason="agent_error" if failed else "", response_len=5, num_turns=1,
                             segment_breaks=0)


def test_outcome_rates_give_totals_and_kinds_and_count_failures_as_misses():
    from jobs.eval import outcome_rates
    from rlsys.envs.tictactoe import reward

    items = [{"board": b} for b in (WIN, WIN, BLOCK, OTHER)]
    # a failed episode whose outcome still says "win" (the agent raised after the call): a miss everywhere
    summaries = [_summary("win"), _summary("win", failed=True), _summary("optimal"), _summary("legal_suboptimal")]
    m = outcome_rates(reward, items, summaries)
    assert m["win_move_rate"] == 0.25 and m["optimal_move_rate"] == 0.5 and m["legal_move_rate"] == 0.75
    assert m["win_taken_rate"] == 0.5 and m["win_episodes"] == 2.0
    assert m["block_rate"] == 1.0 and m["other_optimal_rate"] == 0.0 and m["lost_episodes"] == 0.0
    assert "lost_legal_rate" not in m


def test_outcome_rates_of_a_module_without_hooks_are_empty_and_without_kinds_only_totals():
    from jobs.eval import outcome_rates

    assert outcome_rates(types.SimpleNamespace(), [{"board": WIN}], [_summary("win")]) == {}
    totals_only = types.SimpleNamespace(summarize=lambda outcomes: {"solved_rate": 1.0})
    assert outcome_rates(totals_only, [{}], [_summary("solved")]) == {"solved_rate": 1.0}


def test_format_table_prints_the_kinds_under_the_totals():
    from jobs.eval import format_table

    variant = {"episodes": 4, "valid_call_rate": 1.0, "legal_move_rate": 0.75, "optimal_move_rate": 0.5,
               "win_move_rate": 0.25, "win_taken_rate": 0.5, "block_rate": 1.0, "other_optimal_rate": 0.0,
               "win_episodes": 2.0, "block_episodes": 1.0, "lost_episodes": 0.0, "other_episodes": 1.0,
               "rewards_mean": 0.4, "failed_frac": 0.25, "errors": {"win": 0.25}}
    report = {"model_path": "m", "num_boards": 4, "boards": "b", "samples": 1, "temperature": 0.0,
              "time_s": {"episodes": 1.0}, "variants": {"default": variant}}
    lines = format_table(report).splitlines()
    head = next(i for i, line in enumerate(lines) if "by kind of board" in line)
    assert "win 2, block 1, lost 0, other 1" in lines[head]
    assert [line.split()[0] for line in lines[head + 1: head + 4]] == ["win_taken_rate", "block_rate",
                                                                       "other_optimal_rate"]
    assert lines[head + 1].split()[1] == "0.500"
    assert not any("lost_legal_rate" in line for line in lines)
    assert lines.index(next(line for line in lines if "optimal_move_rate" in line)) < head


@pytest.mark.parametrize("key", ["win_taken_rate", "block_rate", "other_optimal_rate", "lost_legal_rate"])
def test_every_kind_rate_key_is_one_the_reward_module_reports(key):
    from jobs.eval import KIND_RATE_KEYS
    from rlsys.envs.tictactoe.reward import KIND_RATES

    assert key in KIND_RATE_KEYS and key in {name for name, _ in KIND_RATES.values()}
