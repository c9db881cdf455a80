"""Read the big libraries' files into the page cache at the start of a job, in parallel, before anyone imports them.

`cluster.prefetch` (off by default). An import reads its files one after another (each shared library by page
faults as it is mapped); eight threads reading whole files at once keep the disk busy instead, and the page cache is
the machine's, so the actors' and vLLM's processes started afterwards find the files there too. Measured on an
H200: 5.65 GiB in 4.8 s warm and 6.3-10.5 s cold, but no start-up measured faster for it (docs/performance.md,
section 5: the fresh machines' "slow driver" it was written for turned out to be the benchmark script's clock
starting with the model build, and vLLM's slow warm-up there is mostly Triton compiling kernels).

Nothing is imported here: packages are found with `importlib.util.find_spec`. What is read: shared libraries
(`*.so`, `*.so.N`) and compiled modules (`*.pyc`) of torch, transformers, Ray, vLLM, the CUDA libraries (`nvidia`),
Triton, tokenizers and safetensors, in that order, then the model's directory; headers, tests and sources are not.
"""
from __future__ import annotations

import importlib.util
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("torch", "transformers", "ray", "vllm", "nvidia", "triton", "tokenizers", "safetensors")
SKIP_DIRS = frozenset({"include", "tests", "test", "testing", "examples", "benchmarks", "docs"})
MODEL_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja")
THREADS = 8
CHUNK = 8 << 20


@dataclass
class PrefetchRun:
    """What one prefetch read, and when (time.time()); `done_at` is None until every thread finished."""
    started_at: float = field(default_factory=time.time)
    done_at: float | None = None
    files: int = 0
    bytes: int = 0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, ok: bool) -> None:
        with self._lock:
            self.files += ok
            self.bytes += nbytes
            self.errors += not ok


last_run: PrefetchRun | None = None  # the process's prefetch (the driver reads it for `startup/prefetch_done_s`)


def package_roots(names: Iterable[str] = PACKAGES) -> list[Path]:
    """The installed directories of ``names`` (namespace packages such as `nvidia` may have several)."""
    roots: list[Path] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        for location in spec.submodule_search_locations or ():
            path = Path(location)
            if path.is_dir() and path not in roots:
                roots.append(path)
    return roots


def library_files(root: Path) -> Iterator[Path]:
    """Shared libraries and compiled modules under ``root``, skipping headers, tests, examples and docs."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith((".so", ".pyc")) or ".so." in name:
                yield Path(dirpath, name)


def model_files(model_dir: str | os.PathLike | None) -> list[Path]:
    """The weights, config and tokenizer files of a local model directory (nothing for a hub name)."""
    if not model_dir or not Path(model_dir).is_dir():
        return []
    return sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.name.endswith(MODEL_SUFFIXES))


def read_file(path: Path, buf: bytearray) -> int:
    """Read ``path`` once, whole, into nothing (its pages stay in the page cache); returns its bytes."""
    total = 0
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return total


def start(model_dir: str | os.PathLike | None = None, *, packages: Iterable[str] = PACKAGES,
          threads: int = THREADS, verbose: bool = True) -> PrefetchRun:
    """Read the libraries of ``packages``, then ``model_dir``'s files, on ``threads`` daemon threads; returns at
    once. When done it prints one line (``verbose``) and sets `done_at`."""
    global last_run
    run = last_run = PrefetchRun()
    todo: queue.Queue[Path | None] = queue.Queue(maxsize=4096)
    roots = package_roots(packages)

    def produce() -> None:  # walks the trees while the readers read: the first files go out at once
        try:
            for root in roots:
                for path in library_files(root):
                    todo.put(path)
            for path in model_files(model_dir):
                todo.put(path)
        finally:
            for _ in range(threads):
                todo.put(None)

    def consume() -> None:
        buf = bytearray(CHUNK)
        while (path := todo.get()) is not None:
            try:
                run.add(read_file(path, buf), True)
            except OSError:
                run.add(0, False)

    readers = [threading.Thread(target=consume, name=f"rlsys-prefetch-{i}", daemon=True) for i in range(threads)]

    def finish() -> None:  # when every reader is done
        for reader in readers:
            reader.join()
        run.done_at = time.time()
        if verbose:
            print(f"rlsys: prefetched {run.files} library and model files ({run.bytes / 2**30:.2f} GiB) into "
                  f"the page cache in {run.done_at - run.started_at:.1f} s", flush=True)

    threading.Thread(target=produce, name="rlsys-prefetch-walk", daemon=True).start()
    for reader in readers:
        reader.start()
    threading.Thread(target=finish, name="rlsys-prefetch-done", daemon=True).start()
    return run


def wanted(setting: bool | str) -> bool:
    """`cluster.prefetch`: True, False, or `auto` = on a machine with an NVIDIA GPU (where the libraries are GiBs
    and a fresh machine's disk is cold); off on CPU boxes, whose few libraries a job imports in seconds."""
    if setting == "auto":
        return os.path.exists("/dev/nvidiactl")
    return bool(setting)


def start_for(cfg) -> PrefetchRun | None:
    """The job's prefetch, if `cluster.prefetch` wants one (the model: `model.ckpt` when it is a local directory);
    once a process: a recipe's later stages find the files already read."""
    if not wanted(cfg.cluster.prefetch):
        return None
    return last_run if last_run is not None else start(cfg.model.ckpt)
