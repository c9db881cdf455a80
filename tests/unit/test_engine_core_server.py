"""The engine-core fork server (rlsys/engines/vllm_engine.py): its children have the preloaded modules without
importing them, and the parent's environment of the moment they start; vLLM's context hook is scoped."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest

from rlsys.engines.vllm_engine import EngineCoreContext, engine_core_from, probe_in, start_engine_core_server

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


def probe_result() -> tuple[bool, int]:
    return PRELOAD in sys.modules, os.getppid()


def test_registry_probe_runs_in_a_child_of_the_server():
    ctx = start_engine_core_server((PRELOAD,))
    preloaded, ppid = probe_in(ctx)(probe_result)  # vLLM passes a cloudpickled lambda the same way
    assert preloaded and ppid != os.getpid()


def test_registry_probe_failure_is_an_error():
    ctx = start_engine_core_server((PRELOAD,))
    with pytest.raises(RuntimeError, match="model-registry probe failed"):
        probe_in(ctx)(lambda: os._exit(3))


def test_vllm_hooks_are_replaced_only_inside_the_block():
    calls = []

    def original():
        calls.append("vllm")
        return "vllm's context"

    def subprocess_probe(fn):
        return "vllm's subprocess"

    utils = types.SimpleNamespace(get_mp_context=original)
    registry = types.SimpleNamespace(_run_in_subprocess=subprocess_probe)
    ctx = EngineCoreContext()
    with engine_core_from(ctx, utils, registry):
        assert utils.get_mp_context() is ctx
        assert calls == ["vllm"], "vLLM's own get_mp_context still runs (it sets RAY_ADDRESS in a Ray actor)"
        assert registry._run_in_subprocess is not subprocess_probe
    assert utils.get_mp_context is original and registry._run_in_subprocess is subprocess_probe
    with engine_core_from(None, utils, registry):  # rollout.engine_process = spawn
        assert utils.get_mp_context is original and registry._run_in_subprocess is subprocess_probe


def test_vllm_hooks_restored_when_the_build_fails():
    utils = types.SimpleNamespace(get_mp_context=lambda: "vllm's context")
    registry = types.SimpleNamespace(_run_in_subprocess=lambda fn: None)
    originals = utils.get_mp_context, registry._run_in_subprocess
    with pytest.raises(RuntimeError, match="failed to build"), engine_core_from(EngineCoreContext(), utils, registry):
        raise RuntimeError("the engine failed to build")
    assert (utils.get_mp_context, registry._run_in_subprocess) == originals


def test_a_vllm_without_the_hooks_is_left_alone():
    utils, registry = types.SimpleNamespace(), types.SimpleNamespace()
    with engine_core_from(EngineCoreContext(), utils, registry):
        assert not hasattr(utils, "get_mp_context") and not hasattr(registry, "_run_in_subprocess")


def test_the_default_preload_survives_a_missing_vllm():
    """Without vLLM (this box) the server's preload reports what it could not import and the server still forks."""
    code = ("import os, sys; sys.modules.pop('vllm', None)\n"
            "from rlsys.engines.vllm_engine import probe_in, start_engine_core_server\n"
            "ctx = start_engine_core_server()\n"
            "print('child', probe_in(ctx)(os.getppid) != os.getpid())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "child True" in done.stdout
    if importlib.util.find_spec("vllm") is None:
        assert "could not import vllm.v1.engine.core" in done.stderr


def test_the_server_preloads_the_models_vllm_module(tmp_path):
    """The architecture in the model's config.json reaches the server (not this process's environment), whose
    preload imports the module vLLM's registry names for it; an architecture vLLM does not know is skipped."""
    fake = tmp_path / "site"
    (fake / "vllm" / "model_executor" / "models").mkdir(parents=True)
    for package in ["vllm", "vllm/model_executor", "vllm/model_executor/models"]:
        (fake / package / "__init__.py").write_text("")
    (fake / "vllm" / "model_executor" / "models" / "registry.py").write_text(
        "import types\n"
        "ModelRegistry = types.SimpleNamespace(models={'FakeForCausalLM': types.SimpleNamespace(module_name='fake_arch')})\n")
    (fake / "fake_arch.py").write_text("")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["FakeForCausalLM", "UnknownForCausalLM"]}')
    code = ("import os, sys\n"
            "from rlsys.engines.vllm_engine import model_architectures, probe_in, start_engine_core_server\n"
            f"archs = model_architectures({str(model)!r})\n"
            "ctx = start_engine_core_server(architectures=archs)\n"
            "print('archs', ','.join(archs))\n"
            "print('server', probe_in(ctx)(lambda: 'fake_arch' in sys.modules))\n"
            "print('parent', 'fake_arch' in sys.modules, os.environ.get('RLSYS_PRELOAD_ARCHITECTURES'))\n")
    path = os.pathsep.join(filter(None, [os.getcwd(), str(fake), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr
    assert "archs FakeForCausalLM,UnknownForCausalLM" in done.stdout
    assert "server True" in done.stdout, done.stderr
    assert "parent False None" in done.stdout


def test_model_architectures_without_a_usable_config(tmp_path):
    from rlsys.engines.vllm_engine import model_architectures

    assert model_architectures(str(tmp_path)) == ()  # no config.json (a GGUF file's directory, a hub name)
    (tmp_path / "config.json").write_text("{not json")
    assert model_architectures(str(tmp_path)) == ()
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM", "../../etc", 3]}')
    assert model_architectures(str(tmp_path)) == ("Qwen2ForCausalLM",)


def test_model_runner_choice_reaches_vllms_variable(monkeypatch):
    from rlsys.engines.vllm_engine import MODEL_RUNNER_ENV, set_model_runner

    monkeypatch.setenv(MODEL_RUNNER_ENV, "1")
    set_model_runner("auto")  # the environment's (or vLLM's) choice stays
    assert os.environ[MODEL_RUNNER_ENV] == "1"
    set_model_runner("v1")
    assert os.environ[MODEL_RUNNER_ENV] == "0"
    set_model_runner("v2")
    assert os.environ[MODEL_RUNNER_ENV] == "1"
    with pytest.raises(ValueError, match="auto, v1 or v2"):
        set_model_runner("v3")


def test_graph_mode_builds_vllms_compilation_config():
    from rlsys.engines.vllm_engine import compilation_config

    assert compilation_config(enforce_eager=True, graph_mode="full_decode", max_batch_size=64) is None
    # vLLM's default compile, but no graphs captured beyond the engine's concurrency
    assert compilation_config(enforce_eager=False, graph_mode="compile", max_batch_size=64) == {
        "max_cudagraph_capture_size": 64}
    full = compilation_config(enforce_eager=False, graph_mode="full_decode", max_batch_size=256)
    assert full == {"max_cudagraph_capture_size": 256, "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    with pytest.raises(ValueError, match="compile or full_decode"):
        compilation_config(enforce_eager=False, graph_mode="piecewise", max_batch_size=64)


def test_compile_caches_go_under_the_rlsys_cache_unless_set(monkeypatch, tmp_path):
    from rlsys.engines.vllm_engine import COMPILE_CACHE_ENV, set_compile_caches

    for var in COMPILE_CACHE_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RLSYS_CACHE", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")  # a user's own setting wins
    got = set_compile_caches()
    assert got["VLLM_CACHE_ROOT"] == str(tmp_path / "compile" / "vllm")
    assert got["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    assert got["TRITON_CACHE_DIR"] == "/elsewhere/triton"
    assert os.environ["VLLM_CACHE_ROOT"] == got["VLLM_CACHE_ROOT"]


def test_graph_mode_config_field_refuses_unknown_modes():
    from rlsys.config import ConfigError, load_config

    cfg = load_config(overrides=["rollout.graph_mode=full_decode"])
    assert cfg.rollout.graph_mode == "full_decode"
    with pytest.raises(ConfigError, match="graph_mode"):
        load_config(overrides=["rollout.graph_mode=piecewise"])
