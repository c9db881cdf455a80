"""deploy/: the `ray up` YAML passes Ray's own cluster schema; the KubeRay RayJob's pod templates pass the
Kubernetes schema (kubernetes-validate; the RayJob CRD itself is not on any registry) and its entrypoint
runs a config and module that exist; the local head script is valid bash."""
from __future__ import annotations

import copy
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def test_ray_up_yaml_passes_rays_cluster_schema():
    util = pytest.importorskip("ray.autoscaler._private.util")
    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    util.validate_config(util.prepare_config(copy.deepcopy(cfg)))
    cfg["not_a_ray_field"] = 1  # the check is real: an unknown field is refused
    with pytest.raises(Exception, match="not_a_ray_field"):
        util.validate_config(util.prepare_config(cfg))
    assert all("RAY_AUTH_MODE=token" in c for c in cfg["head_start_ray_commands"][1:] + cfg["worker_start_ray_commands"][1:])


def test_kuberay_rayjob_pod_templates_pass_the_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate")
    job = yaml.safe_load((DEPLOY / "kuberay-rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]["rayClusterSpec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for i, template in enumerate(templates):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"t{i}"}, "spec": template["spec"]}
        kv.validate(pod, "1.33.0", strict=True)
    gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for g in spec["workerGroupSpecs"])
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "jobs.train"] and (ROOT / "jobs" / "train.py").is_file()
    assert (ROOT / argv[argv.index("--config") + 1]).is_file()
    assert int(argv[argv.index("--world-size") + 1]) == gpus  # one learner rank and engine share per GPU


def test_local_head_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(DEPLOY / "start-local-head.sh")], check=True)
