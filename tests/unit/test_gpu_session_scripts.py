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


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python3 on the GPU machine: `-m rlsys.cli train ... --run-dir DIR` logs its start and end
if [ "$1 $2 $3" = "-m rlsys.cli train" ]; then
  while [ $# -gt 0 ]; do [ "$1" = --run-dir ] && dir=$2; shift; done
  echo "start $(basename "$dir") $(date +%s.%N)" >> "$FAKE_LOG"; sleep 1.5
  echo "end $(basename "$dir") $(date +%s.%N)" >> "$FAKE_LOG"
fi
exit 0
"""


def test_session_queue_runs_at_most_max_runs_at_once(tmp_path):
    """A fourth Qwen 0.5B run beside three died of CUDA OOM on an H100 (2026-12-05): the queue starts no more than
    the GPU holds (MAX_RUNS, else its memory / RUN_GIB) and starts the next one when a run ends."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(FAKE_PYTHON)
    (fake / "python3").chmod(0o755)
    log = tmp_path / "runs.log"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "FAKE_LOG": str(log), "OUT": str(tmp_path / "out"),
           "RLSYS_SESSION_DIR": str(tmp_path / "session"), "RLSYS_RUNS_DIR": str(tmp_path / "runs"),
           "RUNS": "a=seed=0 b=seed=1 c=seed=2 d=seed=3 e=seed=4", "MAX_RUNS": "2", "FIRST_ALONE": "0",
           "STAGGER_S": "0"}
    subprocess.run(["bash", "tests/gpu/session.sh", "queue"], cwd=ROOT, env=env, check=True, timeout=120)
    events = sorted((float(t), kind, name) for kind, name, t in (line.split() for line in log.read_text().splitlines()))
    assert sorted(name for _, kind, name in events if kind == "start") == list("abcde")
    running, most = 0, 0
    for _, kind, _ in events:
        running += 1 if kind == "start" else -1
        most = max(most, running)
    assert most == 2, events  # two at once, never three
    assert "at most 2 run(s) at once" in (tmp_path / "session" / "queue.log").read_text()
    assert (tmp_path / "session" / "done").exists()


def test_detach_hands_the_callers_output_back_at_once(tmp_path):
    """`detach` (tests/gpu/device_env.sh) starts the suite and the queue so that they outlive the device call: the
    call's own output must end when the call's script does, not when the detached work does (`all.sh start | tail`
    held a start call until its 90 s limit, 2026-12-06), and the work's output goes to its log."""
    pid_file, log = tmp_path / "work.pid", tmp_path / "work.log"
    script = (f'source tests/gpu/device_env.sh; (cd "{tmp_path}" && TAG=t7 detach "{log}" '
              f'bash -c \'echo $$ > "{pid_file}"; echo "work $TAG in $PWD"; sleep 30\'); echo started')
    t0 = time.monotonic()
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**os.environ, "OUT": str(tmp_path / "out")},
                         capture_output=True, text=True, timeout=25)  # stdout a pipe, read to its end
    took = time.monotonic() - t0
    try:
        for _ in range(50):
            if pid_file.exists() and log.exists() and log.read_text():
                break
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        os.kill(pid, 0)  # still running after the caller's output ended
        assert os.getsid(pid) != os.getsid(0)  # in a session of its own
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), 15)
    assert took < 10, f"the caller's output stayed open {took:.0f} s"
    assert out.stdout.strip() == "started"
    assert log.read_text().strip() == f"work t7 in {tmp_path}"


def test_session_queue_after_suite_starts_its_runs_once_the_suite_ended(tmp_path):
    """AFTER_SUITE=1: one device call starts the suite and the queue; the queue's runs wait until the suite's process
    is gone (each measured alone on the GPU), and do not wait for a suite that is not running."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(FAKE_PYTHON)
    (fake / "python3").chmod(0o755)
    suite = tmp_path / "suite"
    suite.mkdir()
    log = tmp_path / "runs.log"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "FAKE_LOG": str(log), "OUT": str(tmp_path / "out"),
           "RLSYS_SESSION_DIR": str(tmp_path / "session"), "RLSYS_RUNS_DIR": str(tmp_path / "runs"),
           "RLSYS_ALL_DIR": str(suite), "RUNS": "a=seed=0", "MAX_RUNS": "1", "FIRST_ALONE": "0", "AFTER_SUITE": "1",
           "STAGGER_S": "0"}
    suite_started = time.time()
    sleeper = subprocess.Popen(["sleep", "5"])  # the suite, still running
    threading.Thread(target=sleeper.wait, daemon=True).start()
    (suite / "run.pid").write_text(f"{sleeper.pid}\n")
    try:
        subprocess.run(["bash", "tests/gpu/session.sh", "queue"], cwd=ROOT, env=env, check=True, timeout=60)
    finally:
        sleeper.kill()
    start = float(log.read_text().split()[2])  # "start a <time>"
    assert start >= suite_started + 4.5, start - suite_started  # after the suite's 5 s, not at once
    queue_log = (tmp_path / "session" / "queue.log").read_text()
    assert "waiting for the GPU suite to end" in queue_log and "the suite has ended" in queue_log

    log.unlink()
    t0 = time.monotonic()  # the suite is gone now: no wait
    subprocess.run(["bash", "tests/gpu/session.sh", "queue"], cwd=ROOT, env=env, check=True, timeout=60)
    assert time.monotonic() - t0 < 4 and log.read_text().startswith("start a")
