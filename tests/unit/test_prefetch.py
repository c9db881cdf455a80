"""rlsys/prefetch.py: which files it reads, that it reads them whole, and that it never imports a package."""
from __future__ import annotations

import sys
import time
import types

import pytest

from rlsys import prefetch


def make_package(root, name="fakepkg_rlsys"):
    pkg = root / name
    (pkg / "lib").mkdir(parents=True)
    (pkg / "include").mkdir()
    (pkg / "tests").mkdir()
    (pkg / "__pycache__").mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('prefetch must not import me')\n")
    wanted = {pkg / "lib" / "libbig.so": 3 * prefetch.CHUNK + 5, pkg / "lib" / "libcuda_thing.so.12": 100,
              pkg / "__pycache__" / "__init__.cpython-311.pyc": 10}
    for path, size in wanted.items():
        path.write_bytes(b"x" * size)
    (pkg / "include" / "header.so").write_bytes(b"skipped: under include/")
    (pkg / "tests" / "libtest.so").write_bytes(b"skipped: under tests/")
    (pkg / "lib" / "source.cu").write_bytes(b"skipped: not a library")
    return wanted


def test_reads_libraries_and_model_files_whole_without_importing(tmp_path, monkeypatch):
    wanted = make_package(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w" * 1000)
    (model / "config.json").write_text("{}")
    (model / "notes.md").write_text("not a model file")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = prefetch.start(model, packages=["fakepkg_rlsys", "no_such_package_rlsys"], threads=3, verbose=False)
    deadline = time.time() + 30
    while run.done_at is None and time.time() < deadline:
        time.sleep(0.01)
    assert run.done_at is not None and prefetch.last_run is run
    assert "fakepkg_rlsys" not in sys.modules
    assert run.files == len(wanted) + 2 and run.errors == 0
    assert run.bytes == sum(wanted.values()) + 1000 + 2


def test_library_files_skip_headers_tests_and_sources(tmp_path):
    wanted = make_package(tmp_path)
    assert set(prefetch.library_files(tmp_path / "fakepkg_rlsys")) == set(wanted)


def test_no_model_files_for_a_hub_name_or_missing_dir(tmp_path):
    assert prefetch.model_files("Qwen/Qwen2.5-0.5B-Instruct") == []
    assert prefetch.model_files(None) == []
    assert prefetch.model_files(tmp_path / "missing") == []


def test_setting(monkeypatch):
    assert prefetch.wanted(True) and not prefetch.wanted(False)
    monkeypatch.setattr(prefetch.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert prefetch.wanted("auto")
    monkeypatch.setattr(prefetch.os.path, "exists", lambda p: False)
    assert not prefetch.wanted("auto")
    cfg = types.SimpleNamespace(cluster=types.SimpleNamespace(prefetch=False), model=types.SimpleNamespace(ckpt="x"))
    assert prefetch.start_for(cfg) is None


def test_once_a_process(monkeypatch):
    """run_training calls it once per job; a recipe's later stages reuse the first stage's prefetch."""
    earlier = prefetch.PrefetchRun()
    monkeypatch.setattr(prefetch, "last_run", earlier)
    monkeypatch.setattr(prefetch, "start", lambda *a, **k: pytest.fail("a second prefetch started"))
    cfg = types.SimpleNamespace(cluster=types.SimpleNamespace(prefetch=True), model=types.SimpleNamespace(ckpt="x"))
    assert prefetch.start_for(cfg) is earlier
