"""Stopping a local Ray head that a test started with `ray start --head --block` in its own process group."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def _ray_start_pids(group: int) -> list[int]:
    """The `ray start --head` processes of process group ``group`` (the test's head, or the script running it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if os.getpgid(int(entry.name)) == group and b"\0start\0--head" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
    return pids


def stop_head(proc: subprocess.Popen, timeout: float = 30) -> str:
    """Stop the head that ``proc`` started (its process group) and return ``proc``'s output if it was piped.

    SIGTERM goes to the `ray start` process alone: its handler drains the node through the GCS and then stops the
    node's processes (~3 s). SIGTERM to the whole group, as these tests sent it before, killed the GCS first, and
    the drain then waited for it until the test's own timeout (30 and 60 s of CI a test, 2026-12-07). Whatever of
    the group is still there afterwards gets SIGKILL."""
    starts = _ray_start_pids(proc.pid)
    for pid in starts:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if not starts:  # no head found (it died, or never came up): the group as a whole
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # a straggler of the group
    return out or ""
