"""The installable wheel: `python -m build` of a fresh clone makes it, a new virtualenv installs it from the file,
and the CPU job runs from it in a directory outside the repo (2 steps).

The new virtualenv gets the wheel's dependencies (torch, Ray, transformers: ~2 GB) from this machine's set-up venv
through a path line in a .pth file instead of a reinstall (a full `pip install rlsys-*.whl` into a bare venv, with
torch 2.13.0 from the local wheel folder first, took 8 min here); the path line does not run that venv's .pth files,
so its editable rlsys stays out, and the test asserts that rlsys, jobs and actors are imported from the wheel's copy.
The wheel's declared dependencies are checked against the versions the job then runs with.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.loop.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# What the CPU job reads at run time besides code: the tiny model's chat template, the envs' datasets, the play page.
PACKAGE_DATA = ["rlsys/models/chat_template.jinja", "rlsys/envs/tictactoe_game/data/train.jsonl",
                "rlsys/envs/tictactoe_game/data/heldout.jsonl", "rlsys/envs/ledger/data/train.jsonl",
                "rlsys/envs/ledger/data/heldout.jsonl", "rlsys/envs/gsm/data/train.jsonl",
                "rlsys/envs/gsm/data/heldout.jsonl", "jobs/static/play.html"]

CHECK_IMPORTS_AND_REQUIREMENTS = r"""
import json, importlib.metadata as md, rlsys, jobs, actors
from packaging.requirements import Requirement
unmet = []
for line in md.requires("rlsys"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        have = None
    if have is None or not req.specifier.contains(have, prereleases=True):
        unmet.append(f"{line} (have {have})")
print(json.dumps({"files": [rlsys.__file__, jobs.__file__, actors.__file__], "unmet": unmet}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="`build` is in the test extra: bash scripts/setup.sh")
    tmp = tmp_path_factory.mktemp("wheel")
    clone = tmp / "rlsys"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(tmp / "dist"), str(clone)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    (whl,) = (tmp / "dist").glob("rlsys-*.whl")
    assert list((tmp / "dist").glob("rlsys-*.tar.gz")), "python -m build made no sdist"
    return whl


def test_wheel_holds_the_package_data_the_job_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [path for path in PACKAGE_DATA if path not in names]
    assert not missing, f"not in {wheel.name}: {missing} (pyproject.toml [tool.setuptools.package-data])"
    assert not [n for n in names if n.startswith("tests/")], "the wheel ships the tests"


def test_cpu_job_runs_from_the_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_set_up_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}
    env["RAY_AUTH_MODE"] = "token"
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--disable-pip-version-check",
                                str(wheel)], capture_output=True, text=True, env=env, timeout=300)
    assert installed.returncode == 0, installed.stderr[-4000:]

    work = tmp_path / "elsewhere"  # no repo here: everything the job reads comes from the installed wheel
    work.mkdir()
    config = work / "tiny.toml"
    config.write_text((REPO / "configs" / "tictactoe-tiny-cpu.toml").read_text())
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", CHECK_IMPORTS_AND_REQUIREMENTS], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-4000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert all(f.startswith(str(site)) for f in found["files"]), f"not imported from the wheel: {found['files']}"
    assert not found["unmet"], f"the wheel's requirements that the job's environment does not meet: {found['unmet']}"

    run_dir = work / "run"
    job = subprocess.run([str(venv / "bin" / "rlsys"), "train", "--config", str(config), "--max-steps", "2",
                          "--run-dir", str(run_dir), "logging.progress=false"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=540)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(steps) == 2, steps
    assert (run_dir / "checkpoints" / "latest").is_file()
