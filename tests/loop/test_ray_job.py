"""`ray job submit` of the training driver to a `ray start --head` cluster that this test starts.

The head runs with `--block` in its own process group, so the test stops exactly the cluster it started
(a plain `ray stop` would also kill any other local Ray on the machine). Token auth is on (Ray 2.60's
default for local clusters), with the same RAY_AUTH_MODE for the head and the `ray job` client.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.loop.conftest import REPO
from tests.ray_head import stop_head

pytestmark = pytest.mark.timeout(420)
RAY = Path(sys.executable).parent / "ray"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    if not RAY.exists():
        pytest.skip(f"no ray CLI next to {sys.executable}")
    # RAY_JOB_STOP_WAIT_TIME_S: how long `ray job stop` waits after SIGTERM before SIGKILL (default 3 s),
    # read by the head's job supervisor: room for the driver to finish its step and checkpoint
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "RAY_JOB_STOP_WAIT_TIME_S": "120"}
    env.pop("RAY_ADDRESS", None)
    gcs_port, dash_port = _free_port(), _free_port()
    # Every port of this head is a free one: another Ray on the machine (the suite's local cluster, a user's)
    # holds the fixed defaults, e.g. the dashboard agent's 52365, and a head whose job agent cannot bind
    # answers every submit with "No available agent to submit job".
    agent_ports = [f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
                   f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}"]
    head = subprocess.Popen(
        [str(RAY), "start", "--head", "--block", f"--port={gcs_port}", "--node-ip-address=127.0.0.1",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
         *agent_ports, "--num-cpus=2", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash_port}"
    deadline = time.monotonic() + 90
    while True:
        probe = subprocess.run([str(RAY), "job", "list", "--address", address], env=env, capture_output=True, text=True)
        if probe.returncode == 0:
            break
        if head.poll() is not None or time.monotonic() > deadline:
            head.kill()
            pytest.fail(f"ray head did not come up:\n{head.stdout.read() if head.stdout else ''}\n{probe.stderr}")
        time.sleep(2)
    yield address, env
    stop_head(head)


def _ray(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY), *args], env=env, capture_output=True, text=True, cwd=REPO, timeout=120)


def _submit(address: str, env: dict, job_id: str, run_dir, max_steps: int) -> None:
    argv = ["job", "submit", "--address", address, "--no-wait", "--working-dir", str(REPO), "--submission-id",
            job_id, "--", sys.executable, "-m", "jobs.train", "--config", "configs/tictactoe-tiny-cpu.toml",
            "--max-steps", str(max_steps), "--run-dir", str(run_dir), "logging.progress=false"]
    for _ in range(30):  # the head's job agent registers a few seconds after the dashboard answers
        submit = _ray(env, *argv)
        if "No available agent" not in submit.stdout + submit.stderr:
            break
        time.sleep(2)
    assert submit.returncode == 0, submit.stdout + submit.stderr


def _wait(address: str, env: dict, job_id: str, until: tuple[str, ...], timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    status = ""
    while time.monotonic() < deadline:
        status = _ray(env, "job", "status", "--address", address, job_id).stdout.lower()
        if any(f"job '{job_id}' {s}" in status for s in until):
            break
        time.sleep(1)
    return status


def test_ray_job_submit_runs_the_driver_to_success(ray_head, tmp_path):
    address, env = ray_head
    run_dir, job_id = tmp_path / "run", f"rlsys-ok-{os.getpid()}"
    _submit(address, env, job_id, run_dir, max_steps=1)
    status = _wait(address, env, job_id, ("succeeded", "failed", "stopped"))
    logs = _ray(env, "job", "logs", "--address", address, job_id).stdout
    assert f"job '{job_id}' succeeded" in status, f"{status}\n--- job logs ---\n{logs}"
    assert "step 1/1" in logs
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "checkpoints" / "latest").is_file()


def test_ray_job_stop_checkpoints_before_the_driver_exits(ray_head, tmp_path):
    from rlsys.checkpoint import find_resume, read_trainer_state

    address, env = ray_head
    run_dir, job_id = tmp_path / "run", f"rlsys-stop-{os.getpid()}"
    _submit(address, env, job_id, run_dir, max_steps=10_000)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text().strip():
        assert time.monotonic() < deadline, _ray(env, "job", "logs", "--address", address, job_id).stdout
        time.sleep(1)
    stop = _ray(env, "job", "stop", "--address", address, job_id)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    # Ray 2.60 says "Job 'x' was stopped": without "was stopped" here the wait ran to its 300 s deadline
    status = _wait(address, env, job_id, ("was stopped", "stopped", "failed", "succeeded"))
    logs = _ray(env, "job", "logs", "--address", address, job_id).stdout
    assert f"job '{job_id}' was stopped" in status or f"job '{job_id}' stopped" in status, status
    assert "stopped by SIGTERM" in logs, logs[-3000:]
    ckpt = find_resume("auto", run_dir / "checkpoints")
    assert ckpt is not None and read_trainer_state(ckpt)["step"] >= 1
