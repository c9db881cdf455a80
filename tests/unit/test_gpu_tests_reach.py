"""The GPU tests (tests/gpu) run only on a GPU machine, which some sessions never get; what they reach into the
learner and the vLLM engine is checked here on CPU, so that a refactor which renames it fails in CI instead of on
the next GPU run (on 2026-12-07 13 GPU tests failed on `learner._transports`, moved to `learner.sender.transports`
by a split made without device time)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import job_config, make_learner

REPO = Path(__file__).resolve().parents[2]
GPU_TESTS = sorted((REPO / "tests" / "gpu").glob("*.py"))


def _chains(root: str) -> set[tuple[str, ...]]:
    """Every `root.a` and `root.a.b` the GPU tests read, as ("a",) and ("a", "b"); names they assign are left out."""
    found: set[tuple[str, ...]] = set()
    assigned: set[str] = set()
    for path in GPU_TESTS:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            parts = [node.attr]
            value = node.value
            while isinstance(value, ast.Attribute):
                parts.insert(0, value.attr)
                value = value.value
            if not (isinstance(value, ast.Name) and value.id == root):
                continue
            if isinstance(node.ctx, ast.Store) and len(parts) == 1:
                assigned.add(parts[0])
            found.add(tuple(parts[:2]))
    return {chain for chain in found if chain[0] not in assigned}


def test_the_gpu_tests_read_something_of_both():
    learner, engine = _chains("learner"), _chains("engine")
    assert ("export_weights",) in learner and ("load_payload",) in engine, (learner, engine)


def test_what_the_gpu_tests_read_of_the_learner_exists(tmp_path, tiny_model_path):
    learner = make_learner(job_config(tmp_path), tiny_model_path)
    missing = []
    for chain in sorted(_chains("learner")):
        obj = learner
        for name in chain:
            if not hasattr(obj, name):
                missing.append(".".join(chain))
                break
            obj = getattr(obj, name)
    assert not missing, f"tests/gpu read learner attributes that actors/learner.py no longer has: {missing}"


def _engine_names() -> set[str]:
    """What a `VLLMEngine` has, read from its source (importing it is fine, building one needs vLLM and a GPU): its
    class's attributes, its bases' (rlsys/engines/base.py) and every `self.<name> = ...` in them."""
    from rlsys.engines.vllm_engine import VLLMEngine

    names = {n for klass in VLLMEngine.__mro__ for n in vars(klass)}
    for path in (REPO / "rlsys" / "engines" / "vllm_engine.py", REPO / "rlsys" / "engines" / "base.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return names


def test_what_the_gpu_tests_read_of_the_vllm_engine_exists():
    missing = sorted({chain[0] for chain in _chains("engine")} - _engine_names())
    assert not missing, f"tests/gpu read VLLMEngine attributes that rlsys/engines/vllm_engine.py lacks: {missing}"
