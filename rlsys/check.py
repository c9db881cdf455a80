"""`rlsys check`: what this machine has and what a job started here would use. Starts nothing.

Reports Python, torch (CUDA build, devices with free/total memory), vLLM, bitsandbytes, transformers and
Ray versions, the cluster address (`--address`, `cluster.address` or RAY_ADDRESS) and RAY_AUTH_MODE,
whether that cluster (or a local `ray start` head) answers on its GCS port, and the engine, optimizer,
weight transport and dtype that the config (default: the built-in defaults, or `--config FILE` with
the usual flags and overrides) resolves to on this machine. Problems are warnings; the exit status is 0.

Nothing heavy is imported to find out: Ray and vLLM are looked up with `importlib.util.find_spec` and
`importlib.metadata.version` (importing vLLM takes seconds and may initialise CUDA); the cluster probe
is a TCP connect, not `ray.init`, so no cluster is started or joined. torch is imported (rlsys needs it
anyway) for the CUDA facts.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from rlsys.config import ClusterConfig, Config, ConfigError, add_config_args, config_from_args

RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")  # written by `ray start --head`
RAY_TOKEN_FILE = Path.home() / ".ray" / "auth_token"
PROBE_TIMEOUT_S = 1.5


@dataclass
class GPU:
    index: int
    name: str
    free_gib: float
    total_gib: float


@dataclass
class Machine:
    """What is installed and visible; filled by `probe_machine`, or by hand in tests."""

    python: str = platform.python_version()
    executable: str = sys.executable
    torch: str | None = None
    torch_cuda: str | None = None  # the CUDA version torch was built with (None: a CPU build)
    cuda_available: bool = False
    gpus: list[GPU] = field(default_factory=list)
    packages: dict[str, str | None] = field(default_factory=dict)  # name -> version (None: not installed)


@dataclass
class Cluster:
    address: str | None  # what the job would join; None = an embedded local Ray
    address_source: str  # "--address" / "cluster.address" / "RAY_ADDRESS" / "none"
    auth_mode: str | None  # RAY_AUTH_MODE as this process sees it
    token_file: bool  # ~/.ray/auth_token exists (Ray 2.60 then turns token auth on for `ray start`)
    local_head: str | None  # the GCS address in /tmp/ray/ray_current_cluster (a `ray start` head), if any
    reachable: dict[str, bool] = field(default_factory=dict)  # probed address -> answered


@dataclass
class JobPlan:
    """What `rlsys train` with this config would use on this machine."""

    engine: str
    engine_why: str
    optimizer: str
    transport: str
    dtype: str
    layout: str


# --- probes (no Ray, no vLLM imported) -------------------------------------------------------------
def package_version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "installed (version unknown)"


def probe_machine() -> Machine:
    m = Machine(packages={name: package_version(name) for name in
                          ("vllm", "bitsandbytes", "transformers", "ray", "fastapi", "openai", "selenium")})
    try:
        import torch
    except ImportError:
        return m
    m.torch = torch.__version__
    m.torch_cuda = torch.version.cuda
    m.cuda_available = bool(torch.cuda.is_available())
    if m.cuda_available:
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            m.gpus.append(GPU(i, torch.cuda.get_device_name(i), free / 2**30, total / 2**30))
    return m


def gcs_host_port(address: str) -> tuple[str, int] | None:
    """`host:port`, `ray://host:port` or `http://host:port` -> (host, port); None for `auto`/`local`."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host or "127.0.0.1", int(port)


def reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at ``address`` (a GCS or Ray Client port)."""
    hp = gcs_host_port(address)
    if hp is None:
        return False
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return True
    except OSError:
        return False


def probe_cluster(cluster: ClusterConfig, flag_address: str | None) -> Cluster:
    if flag_address:
        address, source = flag_address, "--address"
    elif cluster.address:
        address, source = cluster.address, "cluster.address"
    elif os.environ.get("RAY_ADDRESS"):
        address, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    else:
        address, source = None, "none"
    local_head = None
    if RAY_CURRENT_CLUSTER.is_file():
        local_head = RAY_CURRENT_CLUSTER.read_text().strip() or None
    c = Cluster(address=address, address_source=source, auth_mode=os.environ.get("RAY_AUTH_MODE"),
                token_file=RAY_TOKEN_FILE.is_file(), local_head=local_head)
    for target in dict.fromkeys(filter(None, [address if address not in ("auto", "local") else None, local_head])):
        c.reachable[target] = reachable(target)
    return c


# --- what a job would use (pure: tested with made-up machines) --------------------------------------
def plan_job(cfg: Config, m: Machine) -> tuple[JobPlan, list[str]]:
    """The job's engine, optimizer, transport, dtype and layout on machine ``m``, and the warnings."""
    warnings: list[str] = []
    has_vllm = m.packages.get("vllm") is not None
    has_bnb = m.packages.get("bitsandbytes") is not None
    gpu = m.cuda_available and bool(m.gpus)
    kind = cfg.rollout.engine
    if kind == "auto":
        kind = "vllm" if has_vllm and m.cuda_available else "transformers"
        why = ("auto: CUDA and vLLM present" if kind == "vllm" else
               "auto: " + ("no CUDA" if not m.cuda_available else "vLLM not installed (pip install -e '.[gpu]')"))
    else:
        why = f"rollout.engine={kind}"
    if kind == "vllm" and not has_vllm:
        warnings.append("rollout.engine=vllm but vLLM is not installed: pip install -e '.[gpu]' (vllm==0.26.0)")
    if kind == "vllm" and not m.cuda_available:
        warnings.append("rollout.engine=vllm needs CUDA; this machine has none (use rollout.engine=transformers)")
    if m.cuda_available and not has_vllm:
        warnings.append("CUDA is available but vLLM is not: rollouts will use the (slow) transformers engine")

    if cfg.learner.adam_8bit:
        optimizer = "bitsandbytes AdamW8bit"
        if not m.cuda_available:
            warnings.append("learner.adam_8bit needs CUDA; without it the learner refuses to start (drop --adam-8bit)")
        if not has_bnb:
            warnings.append("learner.adam_8bit needs bitsandbytes: pip install -e '.[gpu]'")
    else:
        optimizer = "torch.optim.AdamW"

    if gpu:
        transport = cfg.sync.transport if cfg.sync.transport != "auto" else (
            "cuda_ipc" if kind == "vllm" else "object_store")
        layout = (f"GPU: one {{GPU: 1, CPU: {cfg.cluster.cpus_per_bundle}}} bundle per GPU ({cfg.cluster.placement_strategy}),"
                  f" learner and rollout share it; {cfg.env.worker_count([os.cpu_count() or 0])} CPU env workers")
        if cfg.cluster.world_size > len(m.gpus):
            warnings.append(f"cluster.world_size={cfg.cluster.world_size} but this machine sees {len(m.gpus)} GPU(s)")
    else:
        transport = "collective (gloo)" if cfg.sync.transport == "collective" else "object_store"
        layout = f"CPU: learner, rollout and {cfg.env.worker_count([os.cpu_count() or 0])} env workers with num_gpus=0"
        if cfg.sync.transport == "cuda_ipc":
            warnings.append("sync.transport=cuda_ipc needs the learner and engine on one GPU; without CUDA "
                            "the CPU layout uses object_store")
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if gpu else "float32")
    if dtype in ("bfloat16", "float16") and not gpu:
        warnings.append(f"model.dtype={dtype} on CPU: slow and imprecise; the default (auto) is float32 on CPU")
    for gpu_dev in m.gpus:
        if gpu_dev.free_gib < 0.5 * gpu_dev.total_gib:
            warnings.append(f"GPU {gpu_dev.index} has {gpu_dev.free_gib:.1f} of {gpu_dev.total_gib:.1f} GiB free: "
                            "another process holds the rest")
    return JobPlan(engine=kind, engine_why=why, optimizer=optimizer, transport=transport, dtype=dtype,
                   layout=layout), warnings


def cluster_warnings(c: Cluster, m: Machine) -> list[str]:
    out = []
    if m.packages.get("ray") is None:
        out.append("Ray is not installed: pip install -e . (ray[default]==2.60.0)")
    elif m.packages.get("ray") != "2.60.0":
        out.append(f"Ray {m.packages.get('ray')}: rlsys is tested with 2.60.0")
    if c.token_file and c.auth_mode != "token":
        out.append(f"~/.ray/auth_token exists but RAY_AUTH_MODE={c.auth_mode or '(unset)'}: Ray 2.60 clusters started "
                   "here use token auth, and the `ray job` CLI then needs RAY_AUTH_MODE=token (export it everywhere)")
    if c.address and c.address not in ("auto", "local"):
        if gcs_host_port(c.address) is None:
            out.append(f"cluster address {c.address!r} ({c.address_source}): not host:port")
        elif not c.reachable.get(c.address):
            out.append(f"cluster address {c.address} ({c.address_source}) does not answer: is the head running?")
    if c.address == "auto" and not (c.local_head and c.reachable.get(c.local_head)):
        out.append("address 'auto' but no running local `ray start` head was found")
    return out


# --- output -----------------------------------------------------------------------------------------
def format_report(m: Machine, c: Cluster, plan: JobPlan, warnings: list[str], config_source: str) -> str:
    def ver(name: str, missing: str = "not installed") -> str:
        return m.packages.get(name) or missing

    lines = ["rlsys check", f"  python        {m.python} ({m.executable})"]
    if m.torch is None:
        lines.append("  torch         not installed")
    else:
        build = f"CUDA {m.torch_cuda} build" if m.torch_cuda else "CPU build"
        lines.append(f"  torch         {m.torch} ({build}); CUDA available: {'yes' if m.cuda_available else 'no'}")
    if m.gpus:
        for g in m.gpus:
            lines.append(f"  gpu {g.index}         {g.name}: {g.free_gib:.1f} GiB free of {g.total_gib:.1f} GiB")
    else:
        lines.append("  gpu           none visible")
    lines += [f"  vllm          {ver('vllm', 'not installed (GPU extra: pip install -e .[gpu])')}",
              f"  bitsandbytes  {ver('bitsandbytes')}",
              f"  transformers  {ver('transformers')}",
              f"  ray           {ver('ray')}"]
    if c.address:
        state = "" if c.address in ("auto", "local") else (" (reachable)" if c.reachable.get(c.address) else " (NOT reachable)")
        lines.append(f"  cluster       {c.address} from {c.address_source}{state}")
    else:
        lines.append("  cluster       no address: `rlsys train` starts an embedded local Ray and stops it at the end")
    if c.local_head:
        up = "reachable" if c.reachable.get(c.local_head) else "not reachable (stale file?)"
        used = "" if c.address in (c.local_head, "auto") else "; not used unless --address/RAY_ADDRESS names it"
        lines.append(f"  local head    {c.local_head} (from {RAY_CURRENT_CLUSTER}): {up}{used}")
    lines.append(f"  RAY_AUTH_MODE {c.auth_mode or '(unset)'}; ~/.ray/auth_token {'present' if c.token_file else 'absent'}")
    lines += [f"a job ({config_source}) would use",
              f"  engine        {plan.engine} ({plan.engine_why})",
              f"  optimizer     {plan.optimizer}",
              f"  transport     {plan.transport}",
              f"  dtype         {plan.dtype}",
              f"  layout        {plan.layout}"]
    if warnings:
        lines.append("warnings")
        lines += [f"  - {w}" for w in warnings]
    else:
        lines.append("no warnings")
    return "\n".join(lines)


def run_check(cfg: Config, flag_address: str | None = None) -> tuple[Machine, Cluster, JobPlan, list[str]]:
    m = probe_machine()
    c = probe_cluster(cfg.cluster, flag_address)
    plan, warnings = plan_job(cfg, m)
    return m, c, plan, warnings + cluster_warnings(c, m)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlsys check", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the facts as JSON instead of the table")
    add_config_args(p)  # --config FILE, --address, --engine, --adam-8bit ... as for `rlsys train`
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        print(f"rlsys check: {err}", file=sys.stderr)
        return 2
    m, c, plan, warnings = run_check(cfg, getattr(args, "flag:--address"))
    if args.json:
        print(json.dumps({"machine": asdict(m), "cluster": asdict(c), "job": asdict(plan), "warnings": warnings},
                         indent=1))
        return 0
    source = f"config {args.config}" if args.config else "the defaults"
    if args.overrides or any(getattr(args, k) is not None for k in vars(args) if k.startswith("flag:")):
        source += " with your flags"
    print(format_report(m, c, plan, warnings, source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
