"""What the engine-core fork server imports before it forks vLLM's engine core (`vllm_engine.start_engine_core_server`).

Only that server imports this module. A module that fails to import here is reported and left to the child,
which imports it itself (as a spawned one would): a preload error must not take the server down, since every
engine-core start of the actor goes through it.
"""
import importlib
import sys

MODULES = ("vllm.v1.engine.core", "vllm.v1.engine.async_llm", "rlsys.engines.vllm_engine")

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception as _err:  # noqa: BLE001 (any import-time failure: the child retries it and reports it)
        print(f"rlsys: the engine-core fork server could not import {_name} ({type(_err).__name__}: {_err}); "
              "its children import it themselves", file=sys.stderr, flush=True)
