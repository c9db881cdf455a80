"""The device-session scripts' `wait` (tests/gpu/session.sh, tests/gpu/all.sh): a wait costs device time, so it must
not sleep on a queue that never started (a start call cut short, a fresh machine), and must wait for one that runs."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _wait(script: str, env_dir: str, workdir: Path, tmp_path: Path, *args: str) -> tuple[float, str]:
    env = {**os.environ, env_dir: str(workdir), "OUT": str(tmp_path / "out"), "WAIT_S": "60"}
    t0 = time.monotonic()
    out = subprocess.run(["bash", f"tests/gpu/{script}", "wait", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    return time.monotonic() - t0, out.stdout + out.stderr


@pytest.mark.parametrize("script, env_dir, pid_file, args", [
    ("session.sh", "RLSYS_SESSION_DIR", "queue.pid", ("60",)),
    ("all.sh", "RLSYS_ALL_DIR", "run.pid", ()),
])
def test_wait_returns_at_once_without_a_queue_and_waits_for_a_live_one(tmp_path, script, env_dir, pid_file, args):
    work = tmp_path / "work"
    work.mkdir()
    took, said = _wait(script, env_dir, work, tmp_path, *args)  # nothing started here
    assert "not waiting" in said, said
    assert took < 30, f"{script} wait slept {took:.0f} s on no queue"

    sleeper = subprocess.Popen(["sleep", "6"])  # a queue that lives 6 s, then ends without its done file
    threading.Thread(target=sleeper.wait, daemon=True).start()  # reaped when it ends (a zombie passes `kill -0`)
    try:
        (work / pid_file).write_text(f"{sleeper.pid}\n")
        took, said = _wait(script, env_dir, work, tmp_path, *args)
    finally:
        sleeper.kill()
    assert took >= 5, f"{script} wait returned after {took:.1f} s while its queue still ran"
    assert took < 40 and "not waiting" in said, (took, said)  # and stopped once it had ended
