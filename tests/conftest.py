"""Shared fixtures: a real local Ray (address="local", 2 CPUs) for the loop and fault suites, the tiny model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "loop" / "plugins"


@pytest.fixture(autouse=True)
def _cpu_learner_switch_restored():
    """A CPU `Learner` built in this process sets `TRANSFORMERS_SDPA_FORCE_GQA` for the whole process, as its actor
    does (actors/learner_setup.py `cpu_process_settings`); each test ends with the value it found, so one test's
    learner does not change another's attention path (tests/unit/test_memory.py measures the GPU's)."""
    before = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    yield
    if before is None:
        os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)
    else:
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = before


@pytest.fixture(scope="session")
def _ray_session():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_local(_ray_session):
    """A local Ray (2 CPUs) shared by the tests, started again if a test left it (e.g. for a 2-node cluster)."""
    ray = _ray_session
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}})
    return ray


QWEN05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "model_type": "qwen2"}
QWEN15B = {**QWEN05B, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
           "intermediate_size": 8960}


@pytest.fixture
def qwen15b_folder(tmp_path):
    """A model folder with only the config.json of a Qwen2.5-1.5B-shaped model (what the memory estimate reads)."""
    import json

    folder = tmp_path / "q15"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN15B))
    return folder


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from rlsys.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def make_learner(cfg, model_path: str, **kwargs):
    """A learner without Ray, given what the job gives its ranks of ``cfg`` (jobs/placement.py `learner_settings`)."""
    from actors.learner import Learner
    from jobs.placement import learner_settings

    return Learner(learner_settings(cfg, model_path), model_path, **kwargs)


def job_config(tmp_path: Path, *overrides: str, **flags: str):
    """A small tic-tac-toe job config rooted in ``tmp_path``."""
    from rlsys.config import load_config

    base = {"--max-steps": "3", "--run-dir": str(tmp_path / "run"), "--batch-size": "2", "--n-samples": "4",
            "--max-new-tokens": "24", "--mini-bs": "4", "--lr": "1e-3"}
    base.update({f"--{k.replace('_', '-')}": v for k, v in flags.items()})
    return load_config(flags=base, overrides=["logging.progress=false", "data.num_items=64", *overrides])
