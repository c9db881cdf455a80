"""The custom environment of docs/CONTRACTS.md ("Environments"), taken from the doc as it is written, trained for two
steps through the CPU job (tiny model, real local Ray) and evaluated with its perturbation.

Plumbing, not learning: the random tiny model almost never spells a word backwards. Checked: the job loads the
environment from a file named in `env.name` (driver and env workers), trains on its own items (not the generated
boards), logs its error table in its labels, and the held-out evaluation reports its rate for the default and the
perturbed items.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.conftest import REPO, job_config

pytestmark = pytest.mark.timeout(300)
MARKER = "<!-- custom-environment-example -->"
LABELS = ("wrong", "copied", "reversed")


def doc_example() -> str:
    """The python block right after the marker in docs/CONTRACTS.md."""
    text = (REPO / "docs/CONTRACTS.md").read_text()
    found = re.search(re.escape(MARKER) + r"\n```python\n(.*?)\n```", text, re.S)
    assert found, f"docs/CONTRACTS.md: no python block after {MARKER}"
    return found.group(1) + "\n"


def write_example(tmp_path: Path) -> Path:
    path = tmp_path / "reverse_env.py"
    path.write_text(doc_example())
    return path


def test_the_doc_example_is_about_thirty_lines_and_loads_as_an_environment(tmp_path):
    from rlsys.config import DataConfig
    from rlsys.envs import load_environment

    assert len(doc_example().splitlines()) <= 36
    env = load_environment(f"{write_example(tmp_path)}:ENV")
    assert (env.name, env.outcomes, list(env.perturbations)) == ("reverse", LABELS, ["shouted"])
    held_out = env.heldout_items(DataConfig())
    assert [env.outcome({"item": held_out[0], "output": out}) for out in (" onaip\n", "Piano", "pian")] == \
        ["reversed", "copied", "wrong"]
    (loud, _) = env.perturbations["shouted"](held_out)
    assert env.reward({"item": loud, "output": "ONAIP"}) == 1.0
    with pytest.raises(ValueError, match="letters"):
        env.validate_item({"word": "no spaces"})


def test_doc_example_trains_and_evaluates_through_the_cpu_job(ray_local, tmp_path):
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    path = write_example(tmp_path)
    cfg = job_config(tmp_path, f"env.name='{path}:ENV'", "eval.at_end=true", "eval.perturb=true",
                     "rollout.max_new_tokens=8", max_steps="2")
    run_dir = run_training(cfg)

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/failed_frac"] == 0.0 and r["rollout/num_trajectories"] == 8
        assert {k for k in r if k.startswith("error/")} == {f"error/{label}" for label in LABELS}
        assert math.isclose(sum(r[f"error/{label}"] for label in LABELS), 1.0)
        assert math.isfinite(r["train/loss"])
    (end,) = [e for e in read_metrics(run_dir / "eval.jsonl") if e["tag"] == "end"]
    for prefix in ("eval/", "eval/shouted/"):  # two held-out words, each once per variant
        assert end[f"{prefix}num_trajectories"] == 2 and end[f"{prefix}failed_frac"] == 0.0, prefix
        assert 0.0 <= end[f"{prefix}reversed_rate"] <= 1.0, prefix
