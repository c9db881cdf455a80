"""`python -m jobs.bench cpu-decode` on a small shape: both loops run, the JSON has what docs/performance.md reads."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)


def test_bench_cpu_decode_reports_both_loops_and_the_ratio(tmp_path, capsys):
    from jobs.bench import main

    out = tmp_path / "cpu-decode.json"
    rc = main(["cpu-decode", "--boards", "2", "--samples", "2", "--max-new-tokens", "4", "--rounds", "2",
               "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["answers"] == 4 and r["max_new_tokens"] == 4 and len(r["rounds"]) == 2
    assert r["temperature"] == 1.0 and r["top_p"] == 0.9, "the main job's sampling (configs/tictactoe-tiny-gspo.toml)"
    for row in r["rounds"]:
        assert 0 < row["old_tokens"] <= 16 and 0 < row["new_tokens"] <= 16
    assert r["old_tps"] > 0 and r["new_tps"] > 0 and r["ratio"] == pytest.approx(r["new_tps"] / r["old_tps"])
    assert 0.0 <= r["same_answers"] <= 1.0
    printed = capsys.readouterr().out
    assert "ratio" in printed
    # the host beside the numbers (jobs/host.py): this machine's CPUs and a positive probe time, printed too
    assert r["host"]["cpus"] >= 1 and r["host"]["python_probe_ms"] > 0 and r["host"]["cpu_model"]
    assert f"{r['host']['cpus']} CPUs" in printed
