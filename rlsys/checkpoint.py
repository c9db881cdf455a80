"""Checkpoint layout, atomic writes, rotation and the `--resume` lookup.

```
<checkpoint_dir>/step_000100/        a Hugging Face folder (transformers and vLLM load it; with learner.lora
                                     peft's adapter_config.json + adapter_model.safetensors instead, which
                                     `rlsys export --merge` and model.ckpt's resolver merge into one) plus:
    learner_state.pt                 optimizer (8-bit states included), scheduler, torch/python RNG
    trainer_state.json               step, data cursor, rlsys version
    config.resolved.toml
    COMPLETE                         written last inside the folder
<checkpoint_dir>/latest              name of the newest complete checkpoint, replaced atomically
```

A checkpoint is written into a hidden temp folder and renamed into place, and `latest` is replaced only
after that, so a crash at any point leaves either the previous checkpoint or the new one, never half of
one; a folder without `COMPLETE` is never loaded. Rotation keeps the newest `keep` folders.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from rlsys.errors import UserInputError

COMPLETE = "COMPLETE"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(UserInputError):
    """A checkpoint that cannot be resumed from; the message names the path and what is missing."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def new_temp_dir(root: str | Path, step: int) -> Path:
    tmp = Path(root) / f".tmp-step_{step:06d}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    return tmp


def finalize(tmp: Path, root: str | Path, step: int, trainer_state: dict[str, Any], keep: int) -> Path:
    """Seal ``tmp`` (trainer state, COMPLETE), rename it to step_N, point `latest` at it, rotate."""
    (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
    _fsync_dir_files(tmp)
    (tmp / COMPLETE).write_text("ok\n")
    final = step_dir(root, step)
    if final.exists():  # a re-run of the same step (after a resume) replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = Path(root) / f".{LATEST}.{secrets.token_hex(4)}"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, Path(root) / LATEST)
    rotate(root, keep)
    return final


def rotate(root: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop leftovers of interrupted writes."""
    complete = sorted(complete_checkpoints(root), key=lambda p: _step_of(p))
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in Path(root).glob(".tmp-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)


def complete_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]


def find_resume(resume: str, root: str | Path) -> Path | None:
    """`never` -> None; `auto` -> the newest complete checkpoint under ``root`` (None if there is none);
    a path -> that checkpoint, which must be complete."""
    if resume == "never":
        return None
    if resume == "auto":
        root = Path(root)
        latest = root / LATEST
        if latest.is_file():
            candidate = root / latest.read_text().strip()
            if (candidate / COMPLETE).is_file():
                return candidate
        found = complete_checkpoints(root)  # `latest` missing or stale: newest complete folder
        return max(found, key=_step_of) if found else None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume {resume!r}: no such checkpoint folder")
    if not (path / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint.resume {resume!r}: incomplete checkpoint (no {COMPLETE} marker); "
                              "it was being written when the job stopped")
    return path


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    f = Path(path) / TRAINER_STATE
    if not f.is_file():
        raise CheckpointError(f"checkpoint {path}: {TRAINER_STATE} missing")
    return json.loads(f.read_text())


def _step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def _fsync_dir_files(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
