"""Bad input is refused before any work starts (no Ray, no run directory), naming the file, line or field."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlsys.errors import UserInputError
from tests.conftest import REPO, job_config


def _refused(tmp_path, *overrides: str, **flags: str) -> str:
    from jobs.items import preflight

    with pytest.raises(UserInputError) as err:
        preflight(job_config(tmp_path, *overrides, **flags))
    return str(err.value)


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_dataset_lines_that_are_not_json_or_not_boards_are_named(tmp_path):
    from rlsys.envs.tictactoe.dataset import make_item

    good = json.dumps(make_item("X.O......"))
    data = _write(tmp_path / "d.jsonl", f"{good}\n\n{{not json\n")
    assert f"{data}:3: not JSON" in _refused(tmp_path, dataset_path=data)
    bad_board = {"id": "b", "board": "XXXX", "legal_moves": [], "best_moves": []}
    data = _write(tmp_path / "e.jsonl", f"{good}\n{json.dumps(bad_board)}\n")
    assert f"{data}:2:" in _refused(tmp_path, dataset_path=data)
    finished = {"id": "c", "board": "XX.OOOX..", "legal_moves": [3, 8, 9], "best_moves": [3]}
    data = _write(tmp_path / "f.jsonl", f"{good}\n{json.dumps(finished)}\n")
    msg = _refused(tmp_path, dataset_path=data)
    assert f"{data}:2:" in msg and "terminal" in msg  # a finished game is not a board to move on
    data = _write(tmp_path / "g.jsonl", "[1, 2]\n")
    assert f"{data}:1: expected a JSON object" in _refused(tmp_path, dataset_path=data)
    assert "not found" in _refused(tmp_path, dataset_path=str(tmp_path / "missing.jsonl"))


def test_agent_and_reward_files_are_checked(tmp_path):
    missing = tmp_path / "nope.py"
    assert f"agent file {missing}: not found" in _refused(tmp_path, agent_fn=str(missing))
    broken = _write(tmp_path / "broken.py", "async def agent(item, client, model):\n    return (\n")
    assert f"agent file {broken}: syntax error at line" in _refused(tmp_path, agent_fn=broken)
    lacking = _write(tmp_path / "lacking.py", "async def other(item, client, model):\n    return 1\n")
    assert "no function 'agent' (callables there: other)" in _refused(tmp_path, agent_fn=lacking)
    sync = _write(tmp_path / "sync.py", "def agent(item, client, model):\n    return 1\n")
    assert "must be `async def agent(item, client, model)`" in _refused(tmp_path, agent_fn=sync)
    raising = _write(tmp_path / "raising.py", "import not_a_module_anywhere\n")
    assert "importing it raised ModuleNotFoundError" in _refused(tmp_path, reward_fn_path=raising)
    no_reward = _write(tmp_path / "noreward.py", "def score(record):\n    return 0.0\n")
    assert "no function 'reward'" in _refused(tmp_path, reward_fn_path=no_reward)
    assert "no module named 'no_such_pkg'" in _refused(tmp_path, reward_fn_path="no_such_pkg.mod:reward")


def test_cli_refuses_before_ray_or_run_directory_exist(tmp_path):
    bad = _write(tmp_path / "bad.toml", "[rollout]\nbatch_size = 3\n[learner]\nmini_bs = 5\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rlsys.cli", "train", "--config", bad, "--run-dir", str(run_dir)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "learner.mini_bs: 5 does not divide a minibatch of 12" in out.stderr
    assert "Traceback" not in out.stderr and "Ray" not in out.stdout + out.stderr
    assert not run_dir.exists()

    from rlsys.envs.tictactoe.dataset import make_item

    data = _write(tmp_path / "d.jsonl", json.dumps(make_item("X.O......")) + "\nnot json\n")
    out = subprocess.run([sys.executable, "-m", "rlsys.cli", "train", "--dataset-path", data, "--run-dir", str(run_dir)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"{data}:2: not JSON" in out.stderr and not run_dir.exists()


def test_half_written_checkpoints_are_never_loaded(tmp_path):
    from rlsys.checkpoint import COMPLETE, CheckpointError, find_resume

    root = tmp_path / "checkpoints"
    (root / "step_000002").mkdir(parents=True)
    (root / "step_000002" / COMPLETE).write_text("ok\n")
    (root / "step_000004").mkdir()  # killed while writing: no COMPLETE marker
    (root / ".tmp-step_000006-abcd").mkdir()
    (root / "latest").write_text("step_000004\n")  # even a pointer to it is not trusted
    assert find_resume("auto", root) == root / "step_000002"
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        find_resume(str(root / "step_000004"), root)
    assert find_resume("never", root) is None
    assert find_resume("auto", tmp_path / "empty") is None
