"""The README's "Submitting to a Ray cluster" block, run line by line as written, in a fresh clone.

A new user's view: `git clone` of this repo into a temporary directory, its `.venv` a symlink to this machine's
(the two set-up commands' result, without reinstalling torch), then the block's lines in order against the real
local head that its own `bash deploy/start-local-head.sh` starts with token auth, the CPU job to its end (3 steps).
The clone holds what is committed: uncommitted edits to README.md or deploy/ are not what this test runs.

Where the test departs from "as written", and why:
- the head line gets `--block`, free ports and `--num-cpus=2` appended (and DASHBOARD_PORT set): other Rays run on
  this machine and hold Ray's default ports; `--block` keeps the head in this test's process group, which is how
  the test stops exactly the head it started;
- the `ray job` lines get RAY_ADDRESS pointing at that head's dashboard (they default to 127.0.0.1:8265);
- `ray stop` is not run: it stops every Ray on the machine, the other sessions' too. The head's process group is
  stopped instead.
Not run here: the set-up commands (CI runs them verbatim, tests/unit/test_readme.py); the "Scaling out" block
(`my.toml` is a placeholder, `--world-size 8` needs 8 GPUs, `ray up` and `kubectl` need other machines).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.loop.conftest import REPO
from tests.ray_head import stop_head

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HEADING = "## Submitting to a Ray cluster"


def readme_block(readme: str, heading: str) -> list[str]:
    """The command lines of the first ```bash block after `heading` (comments kept: bash ignores them)."""
    section = readme[readme.index(heading):]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[:1]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clone(tmp_path) -> Path:
    repo = tmp_path / "rlsys"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(repo)], check=True, timeout=120)
    venv = REPO / ".venv"
    if not (venv / "bin" / "ray").exists():
        pytest.skip(f"no set-up venv with the ray CLI at {venv} (run scripts/setup.sh)")
    (repo / ".venv").symlink_to(venv)
    return repo


def test_readme_ray_cluster_block_runs_as_written(clone):
    lines = readme_block((clone / "README.md").read_text(), HEADING)
    exports = [line for line in lines if line.startswith("export ")]
    assert "export RAY_AUTH_MODE=token" in exports, lines
    base_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    base_env["RAY_USAGE_STATS_ENABLED"] = "0"
    dash_port = _free_port()
    address = f"http://127.0.0.1:{dash_port}"
    client_env = {**base_env, "RAY_ADDRESS": address}

    def sh(line: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-ec", "\n".join([*exports, line])], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=timeout)

    head, dashboard = None, None
    outputs: dict[str, str] = {}
    try:
        for line in lines:
            if line.startswith("export "):
                continue
            if "ray stop" in line:  # stops every Ray on the machine: the head's process group is stopped below
                continue
            if line.startswith("bash deploy/start-local-head.sh"):
                # the options go before the line's trailing comment, or bash reads them as part of it (the first CI
                # run: no --block, Ray's default ports, and the head's job agent clashing with the suite's Ray)
                line = line.split("#", 1)[0].rstrip()
                extra = [f"--port={_free_port()}", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                         f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
                         f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}"]
                head = subprocess.Popen(["bash", "-ec", "\n".join([*exports, line + " " + " ".join(extra)])],
                                        cwd=clone, env={**base_env, "DASHBOARD_PORT": str(dash_port)},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
                _wait_for_head(head, client_env, clone)
                continue
            for _ in range(30):  # the head's job agent registers a few seconds after the dashboard answers
                done = sh(line, client_env, timeout=420)
                if "No available agent" not in done.stdout + done.stderr:
                    break
                time.sleep(2)
            assert done.returncode == 0, f"`{line}` exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            outputs[line] = done.stdout
            if "ray get-auth-token" in line:  # what the dashboard's token page does with it, while the head is up
                dashboard = _dashboard_auth(address, done.stdout.strip())
    finally:
        if head is not None:
            head_out = stop_head(head)
    assert head is not None, f"the block starts no head: {lines}"
    assert f"Jobs' python: {clone}/.venv/bin/python" in head_out, head_out[-3000:]

    (submit,) = [out for line, out in outputs.items() if "ray job submit" in line]
    assert re.search(r"Job 'raysubmit_\w+' succeeded", submit), submit[-4000:]
    assert "ModuleNotFoundError" not in submit
    (token,) = [out.strip() for line, out in outputs.items() if "ray get-auth-token" in line]
    assert re.fullmatch(r"\S{16,}", token), f"not a token: {token!r}"
    assert dashboard == (401, 200), f"dashboard login: {dashboard} (without the token, with it); want (401, 200)"


def _wait_for_head(head: subprocess.Popen, env: dict, cwd: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        probe = subprocess.run([".venv/bin/ray", "job", "list"], cwd=cwd, env={**env, "RAY_AUTH_MODE": "token"},
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return
        if head.poll() is not None or time.monotonic() > deadline:
            os.killpg(head.pid, signal.SIGKILL)
            out = head.stdout.read() if head.stdout else ""
            pytest.fail(f"the README's head did not come up:\n{out[-4000:]}\n{probe.stderr[-2000:]}")
        time.sleep(2)


def _dashboard_auth(address: str, token: str) -> tuple[int, int]:
    """(status without the token, status with it) of the dashboard's login endpoint, the one its token page posts."""
    bare = httpx.post(f"{address}/api/authenticate", timeout=10).status_code
    good = httpx.post(f"{address}/api/authenticate", headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code
    return bare, good
