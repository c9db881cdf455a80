"""What the engine-core fork server imports before it forks vLLM's engine core (`vllm_engine.start_engine_core_server`).

Only that server imports this module. A module that fails to import here is reported and left to the child,
which imports it itself (as a spawned one would): a preload error must not take the server down, since every
engine-core start of the actor goes through it.

Besides vLLM's engine core, AsyncLLM and GPU worker it imports the vLLM module of each model architecture named in
``RLSYS_PRELOAD_ARCHITECTURES`` (comma-separated, from the model's config.json; set only for the server's start):
vLLM's model-registry probe (a child of this server, `vllm_engine.probe_in`) and the engine core then find
the model's module imported instead of importing it themselves (~9 s on a fresh machine).
"""
import importlib
import os
import sys
import time

_began = time.monotonic()

# the engine core, the AsyncLLM client, and the in-process worker that the engine core loads (one GPU)
MODULES = ("vllm.v1.engine.core", "vllm.v1.engine.async_llm", "vllm.v1.worker.gpu_worker", "rlsys.engines.vllm_engine")


def _report(name: str, err: BaseException) -> None:
    print(f"rlsys: the engine-core fork server could not import {name} ({type(err).__name__}: {err}); "
          "its children import it themselves", file=sys.stderr, flush=True)


def _model_modules(architectures: str) -> list[str]:
    """vLLM's module for each architecture it knows (unknown ones are vLLM's to refuse, later)."""
    from vllm.model_executor.models.registry import ModelRegistry  # noqa: PLC0415

    found = [getattr(ModelRegistry.models.get(arch), "module_name", None) for arch in architectures.split(",")]
    return [name for name in dict.fromkeys(found) if name]


for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception as _err:  # noqa: BLE001 (any import-time failure: the child retries it and reports it)
        _report(_name, _err)

_architectures = os.environ.get("RLSYS_PRELOAD_ARCHITECTURES")  # vllm_engine.PRELOAD_ARCHITECTURES_ENV
_modules: list[str] = []
if _architectures:
    try:
        _modules = _model_modules(_architectures)
    except Exception as _err:  # noqa: BLE001
        _report("vLLM's model registry", _err)
    for _name in _modules:
        try:
            importlib.import_module(_name)
        except Exception as _err:  # noqa: BLE001
            _report(_name, _err)

print(f"rlsys: the engine-core fork server's preload took {time.monotonic() - _began:.1f} s (model modules: "
      f"{', '.join(_modules) or 'none'})", flush=True)
_torch = sys.modules.get("torch")
if _torch is not None and _torch.cuda.is_initialized():  # no vLLM module should; the children would lose the GPU
    print("rlsys: the engine-core fork server's preload initialized CUDA, so its forked engine cores cannot use "
          "the GPU: set rollout.engine_process = \"spawn\"", file=sys.stderr, flush=True)
