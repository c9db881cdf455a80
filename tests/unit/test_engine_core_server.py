"""The engine-core fork server (rlsys/engines/vllm_engine.py): its children have the preloaded modules without
importing them, and the parent's environment of the moment they start; vLLM's context hook is scoped."""
from __future__ import annotations

import os
import sys
import types

from rlsys.engines.vllm_engine import EngineCoreContext, engine_core_from, start_engine_core_server

PRELOAD = "colorsys"  # a stdlib module nothing here imports: only the server's preload can put it there


def report(queue) -> None:
    queue.put({"preloaded": PRELOAD in sys.modules, "late": os.environ.get("RLSYS_TEST_LATE_VAR"),
               "gone": os.environ.get("RLSYS_TEST_GONE_VAR"), "pid": os.getpid(), "ppid": os.getppid()})


def test_children_have_the_preload_and_the_parents_current_environment(monkeypatch):
    monkeypatch.setenv("RLSYS_TEST_GONE_VAR", "set before the server started")
    ctx = start_engine_core_server((PRELOAD,))
    assert isinstance(ctx, EngineCoreContext)
    # set after the server started: a child forked from the server would not see it without the carried environ
    monkeypatch.setenv("RLSYS_TEST_LATE_VAR", "set after the server started")
    monkeypatch.delenv("RLSYS_TEST_GONE_VAR")
    queue = ctx.Queue()
    child = ctx.Process(target=report, args=(queue,))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert got["preloaded"], "the child should come from the server that imported the preload"
    assert got["late"] == "set after the server started"
    assert got["gone"] is None
    assert got["ppid"] != os.getpid(), "forked from the server, not from this process"


def test_vllm_context_hook_is_replaced_only_inside_the_block():
    calls = []

    def original():
        calls.append("vllm")
        return "vllm's context"

    utils = types.SimpleNamespace(get_mp_context=original)
    ctx = EngineCoreContext()
    with engine_core_from(ctx, utils):
        assert utils.get_mp_context() is ctx
        assert calls == ["vllm"], "vLLM's own get_mp_context still runs (it sets RAY_ADDRESS in a Ray actor)"
    assert utils.get_mp_context is original
    with engine_core_from(None, utils):  # rollout.engine_process = spawn
        assert utils.get_mp_context is original


def test_vllm_context_hook_restored_when_the_build_fails():
    utils = types.SimpleNamespace(get_mp_context=lambda: "vllm's context")
    original = utils.get_mp_context
    try:
        with engine_core_from(EngineCoreContext(), utils):
            raise RuntimeError("the engine failed to build")
    except RuntimeError:
        pass
    assert utils.get_mp_context is original


def test_a_vllm_without_the_hook_is_left_alone():
    utils = types.SimpleNamespace()
    with engine_core_from(EngineCoreContext(), utils):
        assert not hasattr(utils, "get_mp_context")
