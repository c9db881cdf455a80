"""The job's Ray side: start (or join) Ray, place the actors, and the phase calls the driver loop makes.

Placement: with GPUs, one placement group with a `{"GPU": 1, "CPU": k}` bundle per GPU and the
rollout actor and learner sharing it with fractional `num_gpus`; without GPUs the same actors with
`num_gpus=0`. Actors are named (`rollout-0`, `learner-0`, `env-<i>`) in a per-job namespace, so the
dashboard's Actors page and `ray list actors` show what is what.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from rlsys import checkpoint as ckpt
from rlsys.config import Config, ConfigError, dump_config
from rlsys.metrics import rollout_metrics
from rlsys.data import DatasetError, ItemStream, read_jsonl
from rlsys.models.resolve import resolve_model
from rlsys.plugins import load_agent, load_reward
from rlsys.sampling import GroupSieve, next_signal_rate
from rlsys.types import Trajectory, TrajectorySummary


def init_ray(cfg: Config, namespace: str) -> bool:
    """Join the cluster at `cluster.address` / RAY_ADDRESS, or start an embedded one; True if we own it."""
    if ray.is_initialized():
        return False
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        # under `ray job submit` the job's working_dir carries actors/ and jobs/ to every worker
        ray.init(address=address, namespace=namespace, log_to_driver=True)
        return False
    pythonpath = os.pathsep.join(filter(None, [str(_repo_root()), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", namespace=namespace, num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}},
             log_to_driver=True)
    return True


def import_meanwhile(name: str) -> None:
    """Start importing module ``name`` on a thread and return: a later ``import`` of it waits for that one (the
    import system's per-module lock) or, if it failed, imports it again and raises its error where it is used.
    The driver's torch import (~3-5 s, through the actors' modules) thus overlaps Ray's start, which mostly
    waits on its processes."""
    def run() -> None:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001,S110 (the import that needs it raises it again, where it is used)
            pass

    threading.Thread(target=run, name=f"import {name}", daemon=True).start()


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def wait_for_stale_actors(namespace: str, timeout_s: float = 60.0) -> None:
    """A restarted job (after a crash, `--resume auto`) reuses its namespace; Ray reaps the dead driver's
    named actors within seconds. Wait for that instead of failing on a taken name."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        alive = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
        if not alive:
            return
        if time.monotonic() > deadline:
            names = ", ".join(a["name"] for a in alive)
            raise RuntimeError(f"namespace {namespace!r} still has actors {names} from another run of this job; "
                               "is it still running? (set cluster.namespace to run both)")
        time.sleep(0.5)


def job_namespace(cfg: Config) -> str:
    if cfg.cluster.namespace:
        return cfg.cluster.namespace
    return "rlsys-" + re.sub(r"[^A-Za-z0-9_.-]", "-", Path(cfg.run_dir).name)


def item_validator(cfg: Config):
    """What every dataset line must satisfy: an SFT chat, or the reward file's optional `validate_item`."""
    if cfg.algo.name == "sft":
        return validate_chat
    reward_fn, _ = load_reward(cfg.env.reward_fn_path)
    return getattr(sys.modules[reward_fn.__module__], "validate_item", None)


def validate_chat(item: dict[str, Any]) -> None:
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("an SFT item needs a non-empty 'messages' list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}]: needs a role of system, user, assistant or tool")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message to learn")


def preflight(cfg: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Everything that can be refused before Ray starts: plug-ins, training and held-out data, a memory budget
    the job does not fit."""
    load_agent(cfg.env.agent_fn)
    load_reward(cfg.env.reward_fn_path)
    check_memory_budget(cfg)
    items = load_items(cfg)
    wants_eval = cfg.eval.at_start or cfg.eval.at_end or cfg.eval.every
    return items, load_eval_items(cfg) if wants_eval else []


def check_memory_budget(cfg: Config) -> None:
    """`rollout.gpu_memory_budget_gib`: estimate the co-located job's GPU memory (rlsys/memory.py) and refuse it
    (ConfigError, exit 2: the estimate table and settings that fit) if it is over the budget or the device."""
    if cfg.rollout.gpu_memory_budget_gib is None:
        return
    from rlsys.memory import GIB, MemoryBudgetError, check_budget, device_total_bytes_nvml

    try:
        est = check_budget(cfg, resolve_model(cfg.model.ckpt), device_total_bytes_nvml())
    except MemoryBudgetError as err:
        raise ConfigError(str(err)) from None
    split = est.split()
    print(f"rlsys: memory budget {cfg.rollout.gpu_memory_budget_gib:g} GiB: estimated {est.total_bytes / GIB:.1f} GiB "
          f"(learner {est.learner_bytes / GIB:.1f}, engine {est.engine_bytes / GIB:.1f}); shares: learner "
          f"{split.learner_bytes / GIB:.1f} GiB, engine {split.engine_bytes / GIB:.1f} GiB", flush=True)


def load_items(cfg: Config) -> list[dict[str, Any]]:
    """Training items: the dataset file, or the generated tic-tac-toe boards (format-only chats for SFT)."""
    if cfg.data.dataset_path:
        return read_jsonl(cfg.data.dataset_path, validate=item_validator(cfg))
    from rlsys.envs.tictactoe.dataset import make_dataset

    boards = make_dataset(cfg.data.num_items, cfg.data.seed)
    if cfg.algo.name == "sft":
        from rlsys.envs.tictactoe.sft_data import make_sft_dataset

        return make_sft_dataset(boards, cfg.data.num_items, cfg.data.seed)
    return boards


def load_eval_items(cfg: Config) -> list[dict[str, Any]]:
    """Held-out items: the eval file, or generated tic-tac-toe boards disjoint from the training boards."""
    if cfg.data.eval_path:
        reward_fn, _ = load_reward(cfg.env.reward_fn_path)
        return read_jsonl(cfg.data.eval_path, validate=getattr(sys.modules[reward_fn.__module__], "validate_item", None))
    if cfg.data.dataset_path and cfg.algo.name != "sft":
        raise DatasetError("data.eval_path: evaluating on a custom dataset needs its own held-out file")
    from rlsys.envs.tictactoe.dataset import make_dataset

    train_boards = [item["board"] for item in make_dataset(cfg.data.num_items, cfg.data.seed)]
    return make_dataset(cfg.data.num_eval_items, cfg.data.seed + 1, exclude=train_boards)


class RayGauges:
    """`ray.util.metrics` gauges (exported for Prometheus; graphs need Prometheus + Grafana, see
    docs/gpu.md, "What rlsys relies on"), tagged with the job's namespace."""

    EXPORTED = {"step": "rlsys_step", "rollout/rewards_mean": "rlsys_reward_mean",
                "perf/tokens_per_s": "rlsys_tokens_per_s", "time/sync": "rlsys_refit_seconds",
                "time/step": "rlsys_step_seconds", "rollout/failed_frac": "rlsys_failed_frac"}

    def __init__(self, namespace: str) -> None:
        from ray.util.metrics import Gauge

        self.tags = {"job": namespace}
        self.gauges = {key: Gauge(name, description=f"rlsys {key}", tag_keys=("job",))
                       for key, name in self.EXPORTED.items()}

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = step + 1 if key == "step" else metrics.get(key)
            if isinstance(value, (int, float)):
                gauge.set(float(value), tags=self.tags)


class EngineGroup:
    """The rollout actors as one: sleep/wake all of them."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def sleep(self, level: int) -> dict[str, float]:
        """Sleep every engine; returns their rollout counters (seconds generating: the longest engine; tokens
        and requests: summed) and GPU memory in use before/after sleeping (the most any engine saw)."""
        out: dict[str, float] = {}
        for stats in ray.get([a.sleep.remote(level) for a in self.actors]):
            for key, value in (stats or {}).items():
                summed = key.startswith("perf/")
                out[key] = out.get(key, 0.0) + value if summed else max(out.get(key, value), value)
        return out

    def wake(self) -> None:
        """After the push: KV cache back, prefix cache reset (it was computed with the old weights)."""
        ray.get([a.wake.remote(["kv_cache"]) for a in self.actors])


@dataclass
class WeightSync:
    """Learners -> engines, behind one call (`push`), then the canary (`check_canary`).

    Engine i is fed by learner rank `sources[i]`, the rank on its GPU (or node), by the transport the placement
    chose for that pair (`jobs.placement.choose_engine_transport`); all ranks hold the same weights, so any rank
    is a correct source. An engine of vLLM Ray workers fed by CUDA IPC (`per_gpu[i]`) gets the handles of every
    worker's rank at once, and each worker opens those of its own GPU. `collective` routes (one group per source
    rank and the engines it feeds) are opened on the first push: the bucket plan goes to the engines once, then
    each push is the learner's broadcasts and the engines' receives, running at the same time."""

    learners: list[Any]
    engines: list[Any]
    sources: list[int]  # (E,) learner rank feeding each engine
    transports: list[str]  # (E,) how weights reach each engine: "cuda_ipc", "collective" or "object_store"
    bucket_bytes: int
    expected_count: int
    canary_prompt: list[int]
    canary_continuation: list[int]
    canary_tol: float
    canary_enabled: bool = True
    canary_every: int = 1  # check after every N-th push (the check at start always runs)
    # the engines must move as far as the learner between checks (`canary_movement`): only where both compute in
    # the same numerics; fp32 masters move in steps below bf16's resolution that the pushed bf16 weights round away
    canary_follow: bool = True
    collective_backend: str = "gloo"  # "nccl" when learners and engines are on GPUs
    collective_timeout_s: float | None = None  # rendezvous and broadcast timeout of collective routes (None: the
    # route's default, rlsys.weights.collective.DEFAULT_TIMEOUT_S)
    # (E,) for an engine of vLLM Ray workers fed by CUDA IPC: (learner rank, GPU uuid) per worker; else None
    per_gpu: list[Any] | None = None
    _routes: dict[int, Any] = field(default_factory=dict, repr=False)  # source rank -> CollectiveRoute
    _tickets: dict[int, Any] = field(default_factory=dict, repr=False)  # engine index -> CollectiveTicket
    _canary_calls: int = field(default=0, repr=False)
    # the last check's logprobs: (T,) the learner's and (E, T) the engines'
    _canary_last: tuple[list[float], list[list[float]]] | None = field(default=None, repr=False)

    @property
    def learner(self) -> Any:
        return self.learners[0]

    def push(self) -> dict[str, float]:
        """Wake the engines' weights (not their KV cache), load the learners' weights, check the count."""
        fed = [[r for r, _ in shards] if shards else [r] for r, shards in zip(self.sources, self._per_gpu())]
        routes = sorted({(r, t) for ranks, t in zip(fed, self.transports) for r in ranks})
        # the learners pack while the engines map their weight memory back: two processes, no ordering needed
        payloads = {(r, t): self.learners[r].export_weights.remote(t, self.bucket_bytes)
                    for r, t in routes if t != "collective"}
        ray.get([e.wake.remote(["weights"]) for e in self.engines])
        tickets = self._collective_tickets()
        sends = [self.learners[r].export_weights.remote("collective", self.bucket_bytes, route)
                 for r, route in self._routes.items()]  # broadcasts, met by the engines' receives below
        loads = []
        for i, (e, r, t, shards) in enumerate(zip(self.engines, self.sources, self.transports, self._per_gpu())):
            if t == "collective":
                loads.append(e.load_weights.remote(tickets[i]))
            elif shards:  # vLLM Ray workers: each opens the handles of the rank on its GPU
                loads.append(e.load_weights_per_gpu.remote([u for _, u in shards], *[payloads[(k, t)] for k, _ in shards]))
            else:
                loads.append(e.load_weights.remote(payloads[(r, t)]))
        counts = ray.get(loads)
        ray.get(sends)
        for i in tickets:  # the plan went with the first push
            tickets[i].plan = None
        if "cuda_ipc" in self.transports:  # the engines answered: IPC memory they released can go
            ray.get([self.learners[r].ipc_collect.remote() for r, t in routes if t == "cuda_ipc"])
        for i, count in enumerate(counts):
            if count != self.expected_count:
                raise RuntimeError(f"weight push: engine {i} loaded {count} tensors, the learner sent "
                                   f"{self.expected_count}; refusing to roll out with partly stale weights")
        return {"sync/tensors": float(self.expected_count)}

    def _per_gpu(self) -> list[Any]:
        return self.per_gpu or [None] * len(self.engines)

    def _collective_tickets(self) -> dict[int, Any]:
        """Engine index -> its CollectiveTicket; on the first call, a route (group) per source rank: the rank's
        node IP and a free port (it hosts the store), and the bucket plan fetched once from a learner."""
        from rlsys.weights.collective import CollectiveRoute, CollectiveTicket

        fed: dict[int, list[int]] = {}
        for i, (r, t) in enumerate(zip(self.sources, self.transports)):
            if t == "collective":
                fed.setdefault(r, []).append(i)
        if fed and not self._routes:
            plan = ray.get(self.learners[min(fed)].weight_plan.remote(self.bucket_bytes))
            for r, engines in sorted(fed.items()):
                host, port = ray.get(self.learners[r].address.remote())
                timeout = {} if self.collective_timeout_s is None else {"timeout_s": self.collective_timeout_s}
                route = CollectiveRoute(
                    name=f"learner-{r} -> " + ", ".join(f"rollout-{i}" for i in engines), host=host, port=port,
                    world_size=1 + len(engines), backend=self.collective_backend, **timeout)
                self._routes[r] = route
                self._tickets.update({i: CollectiveTicket(route=route, rank=k + 1, plan=plan)
                                      for k, i in enumerate(engines)})
        return self._tickets

    def check_canary(self) -> dict[str, float]:
        """The stale-weights alarm: the engines' logprobs on a fixed sequence against the learner's (all scored at
        once: different processes). With `sync.canary_every` N > 1, every N-th call after the first. Also reports
        the engines' mean logprob on it and, from the second check on, `sync/canary_engine_shift`: how far the
        pushes since the last check moved the engine that moved least (0.0 for one that kept its old weights)."""
        calls, self._canary_calls = self._canary_calls, self._canary_calls + 1
        if not self.canary_enabled or calls % self.canary_every:
            return {}
        ref, *scores = ray.get([p.score.remote(self.canary_prompt, self.canary_continuation)
                                for p in [self.learner, *self.engines]])
        worst = 0.0
        for i, lp in enumerate(scores):
            diff = mean_abs_diff(lp, ref)
            if not diff <= self.canary_tol:
                raise RuntimeError(
                    f"stale-weights canary: engine {i} logprobs differ from the learner's by {diff:.3g} "
                    f"(mean over {len(ref)} tokens; tolerance {self.canary_tol:g}): the weight push was "
                    "skipped or corrupted"
                )
            worst = max(worst, diff)
        out = {"sync/canary_logp_diff": worst, "sync/canary_logp_mean": sum(scores[0]) / max(len(scores[0]), 1)}
        if self._canary_last is not None:
            out.update(canary_movement(self._canary_last, ref, scores, enforce=self.canary_follow))
        self._canary_last = ref, scores
        return out


# A push moves the engine as far as the learner moved (their numerics differ, the same change lands on both), so
# an engine that moved less than this share of the learner's move kept (most of) its old weights: caught even when
# the update is smaller than the tolerance, which must cover the dtype gap (fp32 masters vs bf16: 0.025-0.085).
CANARY_MIN_FOLLOW = 0.1
CANARY_MOVE_FLOOR = 1e-4  # below this mean |change| the learner did not move measurably: nothing to follow


def canary_movement(last: tuple[list[float], list[list[float]]], ref: list[float],
                    scores: list[list[float]], enforce: bool = True) -> dict[str, float]:
    """How far the learner's and each engine's canary logprobs moved since the last check; with ``enforce``,
    raises when the learner moved and an engine stood (nearly) still: a push that never reached it."""
    last_ref, last_scores = last
    learner_shift = mean_abs_diff(ref, last_ref)
    shifts = [mean_abs_diff(lp, prev) for lp, prev in zip(scores, last_scores)]
    for i, shift in enumerate(shifts):
        if enforce and learner_shift > CANARY_MOVE_FLOOR and shift < CANARY_MIN_FOLLOW * learner_shift:
            raise RuntimeError(
                f"stale-weights canary: engine {i} logprobs moved {shift:.3g} since the last check while the "
                f"learner's moved {learner_shift:.3g} (mean over {len(ref)} tokens): the weight push did not land")
    return {"sync/canary_engine_shift": min(shifts), "sync/canary_learner_shift": learner_shift}


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    """Mean |a - b| over the positions both have (canary logprobs)."""
    return sum(abs(x - y) for x, y in zip(a, b)) / max(min(len(a), len(b)), 1)


@dataclass
class Job:
    cfg: Config
    namespace: str
    owns_ray: bool
    learners: list[Any]  # ranks of one process group; rank 0 reports metrics and writes checkpoints
    rollouts: list[Any]
    proxies: list[dict[str, Any]]
    env_workers: list[Any]
    engines: EngineGroup
    weights: WeightSync
    data: ItemStream
    model_path: str
    eval_items: list[dict[str, Any]]
    outcome_labels: tuple[str, ...] = ()
    reward_module: str = ""
    start_step: int = 0
    placement_group: Any = None
    startup_marks: dict[str, float] = field(default_factory=dict)  # milestone -> time.time() (Job.start)
    sleep_level: int = 1  # the engines' sleep between rollout and training (`choose_sleep_level`)

    @classmethod
    def start(cls, cfg: Config, checked: tuple[list, list] | None = None,
              marks: dict[str, float] | None = None) -> "Job":
        """Start (or join) Ray and the actors. ``checked`` = what `preflight(cfg)` returned, if it ran; ``marks``:
        the caller's start-up milestones so far (name -> time.time()), kept with Job.start's own."""
        items, eval_items = checked or preflight(cfg)  # bad plug-ins and data: refused before any actor
        resume_from = ckpt.find_resume(cfg.checkpoint.resume, cfg.checkpoint_dir())
        trainer_state = ckpt.read_trainer_state(resume_from) if resume_from else None
        # a resumed job starts learner and engine from the checkpoint's weights
        model_path = str(resume_from) if resume_from else resolve_model(cfg.model.ckpt)
        namespace = job_namespace(cfg)
        marks = {**(marks or {}), "job_start": time.time()}  # when start-up milestones were reached (`startup/*`)
        import_meanwhile("jobs.placement")  # the actors' modules (torch, transformers) while Ray starts
        owns_ray = init_ray(cfg, namespace)
        marks["ray_ready"] = time.time()
        from jobs.placement import make_env_workers, place_actors  # noqa: PLC0415 (waits for that import)

        wait_for_stale_actors(namespace)
        placed = place_actors(cfg, model_path)
        learners, sources = placed.learners, placed.sources
        learner = learners[0]
        # the engines build while the learner ranks load and join their group, and the env workers start
        # (processes, imports) meanwhile too: they need only the engines' nodes
        nodes = ray.get([r.node_id.remote() for r in placed.rollouts])
        marks["actors_up"] = time.time()
        starting = [r.start.remote() for r in placed.rollouts]
        env_workers = make_env_workers(cfg, nodes=nodes)
        try:
            if len(learners) > 1:
                ip, port = ray.get(learner.address.remote())
                ray.get([rank.init_distributed.remote(r, len(learners), f"tcp://{ip}:{port}")
                         for r, rank in enumerate(learners)])
            prompt, continuation = canary_sequence(model_path)  # the driver's own tokenizer load, meanwhile
            infos = ray.get(starting)
            marks["engines_ready"] = time.time()
        except BaseException:  # an engine that fails to build: the workers started for it go too
            for worker in env_workers:
                ray.kill(worker, no_restart=True)
            raise
        feeders = placed.feeders or [[r] for r in sources]
        transports, per_gpu, backend = choose_transports(cfg, learners, placed.rollouts, feeders, infos)
        proxies = [{**info, "transport": t, "actor": r} for info, t, r in zip(infos, transports, placed.rollouts)]
        print(f"rlsys: {len(learners)} learner rank(s), {len(infos)} engine(s); weights by "
              f"{', '.join(sorted(set(transports)))}", flush=True)
        num_params = ray.get(learner.num_parameters.remote())
        marks["learner_ready"] = time.time()
        sleep_level, why = choose_sleep_level(cfg, model_path, infos)
        print(f"rlsys: engines {'stay awake' if sleep_level == 0 else f'sleep at level {sleep_level}'} while the "
              f"learner trains ({why})", flush=True)
        weights = WeightSync(
            learners=learners, engines=placed.rollouts, sources=sources, transports=transports, per_gpu=per_gpu,
            bucket_bytes=cfg.sync.bucket_mb << 20, expected_count=num_params, canary_prompt=prompt,
            canary_continuation=continuation, canary_tol=cfg.sync.canary_tol or placed.canary_tol,
            canary_enabled=cfg.sync.canary, canary_every=cfg.sync.canary_every, collective_backend=backend,
            canary_follow=not cfg.learner.fp32_master,
        )
        data = ItemStream(items, seed=cfg.seed, shuffle=cfg.data.shuffle, replay_frac=cfg.data.signal_replay)
        reward_fn, _ = load_reward(cfg.env.reward_fn_path)
        labels = tuple(getattr(sys.modules[reward_fn.__module__], "OUTCOMES", ()))
        wants_eval = cfg.eval.at_start or cfg.eval.at_end or cfg.eval.every
        job = cls(cfg=cfg, namespace=namespace, owns_ray=owns_ray, learners=learners, rollouts=placed.rollouts,
                  proxies=proxies, env_workers=env_workers, engines=EngineGroup(placed.rollouts), weights=weights,
                  data=data, model_path=model_path, eval_items=eval_items if wants_eval else [],
                  outcome_labels=labels, reward_module=reward_fn.__module__, placement_group=placed.placement_group,
                  startup_marks=marks, sleep_level=sleep_level)
        if resume_from is not None:
            ray.get([rank.load_state.remote(str(resume_from)) for rank in learners])
            data.load_state_dict(trainer_state["data"])
            job.start_step = int(trainer_state["step"])
            job.weights.push()  # after a resume, the weights reach the engine before the first rollout
            job.engines.wake()
            print(f"rlsys: resumed from {resume_from} at step {job.start_step}", flush=True)
        job.weights.check_canary()  # engine and learner start from the same weights
        marks["canary_passed"] = time.time()
        return job

    @property
    def learner(self) -> Any:
        """Rank 0: the learner that reports metrics, scores the canary and writes checkpoints."""
        return self.learners[0]

    # --- phases ----------------------------------------------------------------------------
    def rollout_until_full(self, step: int) -> tuple[list[Any], list[TrajectorySummary], dict[str, float]]:
        """The step's rollout phase: `rollout.batch_size` boards from the data cursor, every sample of each at once;
        under `algo.dynamic_sampling` as many more as the recent share of groups with signal calls for
        (`data.signal_rate`, at most `algo.max_oversample` per group), the groups whose rewards all agree are dropped
        and rounds of more boards are sampled until the batch holds `batch_size` groups with signal or
        `algo.max_sample_rounds` rounds were sampled (rlsys/sampling.py). Every fresh board sampled advances the
        cursor, so a resumed run goes on after them; under `data.signal_replay` the boards whose group had signal
        are queued to come back sooner (the queue is saved with the cursor; `rollout/boards_replayed` counts the
        boards drawn from it).

        Returns the trajectory refs to train on (the kept groups), the summaries of *every* trajectory sampled
        (the step's rollout metrics and error table describe what was sampled) and the `rollout/groups_*` counts."""
        a = self.cfg.algo
        sieve = GroupSieve(want=self.cfg.rollout.batch_size, max_rounds=a.max_sample_rounds,
                           max_oversample=a.max_oversample, mask_truncated=a.mask_truncated,
                           enabled=a.dynamic_sampling)
        refs: list[Any] = []
        summaries: list[TrajectorySummary] = []
        drawn: list[dict[str, Any]] = []  # group g's board is drawn[g]
        boards, replayed = sieve.first_round(self.data.signal_rate), self.data.replayed
        while boards:  # a round: all its boards' episodes submitted at once
            drawn += self.data.next_batch(boards)
            more_refs, more = self.rollout(drawn[sieve.groups_seen:], step, first_group=sieve.groups_seen)
            refs += more_refs
            summaries += more
            sieve.add(more)
            boards = sieve.next_round()
        self.data.replay([drawn[g] for g in sieve.with_signal])  # `data.signal_replay`: drawn again sooner
        self.data.signal_rate = next_signal_rate(self.data.signal_rate, sieve.signal_share())
        keep = sieve.kept()
        counts = sieve.metrics() if a.name != "sft" else {}  # an SFT "group" is one example: nothing to count
        counts["rollout/boards_replayed"] = float(self.data.replayed - replayed)
        if a.dynamic_sampling:
            counts["rollout/signal_rate"] = self.data.signal_rate  # sizes the next step's first round
        if not keep:
            print(f"rlsys: dynamic sampling: none of {sieve.groups_seen} groups sampled in {sieve.rounds} round(s) "
                  "has rewards that differ; this step's update is skipped (raise algo.max_sample_rounds or "
                  "algo.max_oversample, or check the reward)", flush=True)
        return [r for r, s in zip(refs, summaries) if s.group in keep], summaries, counts

    def rollout(self, items: list[dict[str, Any]], step: int,
                first_group: int = 0) -> tuple[list[Any], list[TrajectorySummary]]:
        """Every (item, sample) episode on the env workers; returns trajectory refs and their summaries. Item i is
        group ``first_group + i`` (a top-up round's groups continue the step's numbering).

        For `--algo sft` an episode is an SFT chat rendered by the model's template, not an agent run."""
        if self.cfg.algo.name == "sft":
            return self._episodes(items, 1, lambda w, p, item, g, s: w.sft_example.options(num_returns=2).remote(
                item, g, s, self.model_path), first_group)
        return self._episodes(items, self.cfg.rollout.n_samples, lambda w, p, item, g, s: w.run_episode.options(
            num_returns=2).remote(p, item, g, s, f"seed{self.cfg.seed}-step{step}-item{g}-sample{s}"), first_group)

    def evaluate(self, tag: str) -> dict[str, float]:
        """Held-out episodes at `eval.temperature` (greedy by default); metrics under `eval/`."""
        if not self.eval_items:
            return {}
        from jobs.eval import DEFAULT_VARIANT, outcome_rates, with_variants

        variants = [DEFAULT_VARIANT]
        if self.cfg.eval.perturb:
            from rlsys.envs.tictactoe.prompt import PERTURBATIONS

            variants += list(PERTURBATIONS)
        items = [item for _, item in with_variants(self.eval_items, variants)]
        n = self.cfg.eval.n_samples
        ray.get([r.set_temperature.remote(self.cfg.eval.temperature) for r in self.rollouts])
        try:
            refs, summaries = self._episodes(items, n, lambda w, p, item, g, s:
                                              w.run_episode.options(num_returns=2).remote(
                                                  p, item, g, s, f"eval-{tag}-item{g}-sample{s}"))
        finally:
            ray.get([r.set_temperature.remote(None) for r in self.rollouts])
        del refs  # the driver keeps only the summaries
        reward_module = sys.modules.get(self.reward_module, None)
        per_item = len(self.eval_items) * n  # episodes of one variant, in submission order
        episode_items = [item for item in self.eval_items for _ in range(n)]  # episode k's item: item k // n
        metrics: dict[str, float] = {}
        for k, v in enumerate(variants):
            mine = summaries[k * per_item:(k + 1) * per_item]
            prefix = "eval/" if v == DEFAULT_VARIANT else f"eval/{v}/"
            metrics.update({prefix + (key.split("/", 1)[1] if key.startswith("rollout/") else key): x
                            for key, x in rollout_metrics(mine, self.outcome_labels).items()})
            # the same rates as `rlsys eval` (totals and by kind of board; a failed episode is a miss)
            metrics.update({prefix + key: x for key, x in outcome_rates(reward_module, episode_items, mine).items()})
        return metrics

    def _episodes(self, items: list[dict[str, Any]], n: int, submit,
                  first_group: int = 0) -> tuple[list[Any], list[TrajectorySummary]]:
        return run_episodes(self.env_workers, self.proxies, items, n, submit, progress=self.cfg.logging.progress,
                            first_group=first_group)

    def train(self, traj_refs: list[Any], summaries: list[TrajectorySummary]) -> dict[str, float]:
        """One update on ``traj_refs``; ``summaries`` (of every trajectory sampled) decide a skip for failures. No
        refs (dynamic sampling kept no group): skipped, `train/skipped_batch` 1."""
        if not traj_refs:
            return {"train/skipped_batch": 1.0}
        failed = sum(s.failed for s in summaries) / max(len(summaries), 1)
        if failed > self.cfg.env.max_failed_frac:
            print(f"rlsys: WARNING step skipped: {failed:.0%} of trajectories failed "
                  f"(env.max_failed_frac={self.cfg.env.max_failed_frac})", flush=True)
            return {"train/skipped_batch": 1.0}
        per_rank = ray.get([rank.train.remote(traj_refs) for rank in self.learners])
        stats = per_rank[0]  # rank 0's view
        digests = [r.pop("train/weights_digest") for r in per_rank if "train/weights_digest" in r]
        if len(digests) > 1:  # data parallel: every rank took the same step, so the weights must be bit-equal
            spread = max(abs(d - digests[0]) for d in digests)
            stats["train/rank_weight_spread"] = spread
            if spread:
                print(f"rlsys: WARNING learner ranks' weights differ after this step (digests {digests}): "
                      "a rank missed a gradient all-reduce or an optimizer step", flush=True)
        return {**stats, "train/skipped_batch": 0.0}

    # --- checkpoints (weights; the full resumable state arrives with the reliability work) --
    def maybe_checkpoint(self, step: int) -> None:
        every = self.cfg.checkpoint.save_interval
        if every and step % every == 0 and step < self.cfg.max_steps:
            self.checkpoint(step)

    def checkpoint(self, step: int, final: bool = False) -> Path:
        """Learner state + data cursor + step + config, written atomically (rlsys/checkpoint.py)."""
        root = self.cfg.checkpoint_dir()
        tmp = ckpt.new_temp_dir(root, step)
        ray.get(self.learner.save_state.remote(str(tmp)))
        dump_config(self.cfg, tmp / "config.resolved.toml")
        state = {"step": step, "data": self.data.state_dict(), "seed": self.cfg.seed}
        path = ckpt.finalize(tmp, root, step, state, keep=self.cfg.checkpoint.keep)
        if final:
            print(f"rlsys: checkpoint {path}", flush=True)
        return path

    def shutdown(self) -> None:
        for actor in self.rollouts:
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception as err:  # shutting down anyway; say why it was not clean
                print(f"rlsys: rollout shutdown: {type(err).__name__}: {err}", flush=True)
        for actor in [*self.learners, *self.rollouts, *self.env_workers]:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:  # free the GPU bundles for the next job in this Ray session
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)


def run_episodes(env_workers: list[Any], proxies: list[dict[str, Any]], items: list[dict[str, Any]], n: int,
                 submit, progress: bool = False, desc: str = "rollout",
                 first_group: int = 0) -> tuple[list[Any], list[TrajectorySummary]]:
    """``n`` episodes of every item on the env workers: ``submit(worker, proxy, item, group, sample)`` returns
    the (trajectory, summary) refs of one; item i is group ``first_group + i``. Returns the trajectory refs and
    the summaries, in item-major order.

    Engines take episodes in turn (all are submitted at once, so turn order = least loaded), each on an env
    worker on its engine's node (worker i serves engine i mod E). An episode whose worker died twice comes
    back as a failed trajectory (`worker_died`), never as a hole."""
    traj_refs, summary_refs, keys = [], [], []
    engines = len(proxies)
    local_workers = [env_workers[e::engines] for e in range(engines)]
    k = 0
    for g, item in enumerate(items, first_group):
        for s in range(n):
            e = k % engines
            worker = local_workers[e][(k // engines) % len(local_workers[e])]
            t_ref, s_ref = submit(worker, proxies[e], item, g, s)
            traj_refs.append(t_ref)
            summary_refs.append(s_ref)
            keys.append((item, g, s))
            k += 1
    summaries = _gather(summary_refs, progress, desc)
    for i, summary in enumerate(summaries):
        if summary is None:
            item, g, smp = keys[i]
            t = Trajectory(item_id=str(item.get("id", "")), group=g, sample=smp, failed=True,
                           fail_reason="worker_died: env worker process died during the episode (retried once)")
            traj_refs[i] = ray.put(t)
            summaries[i] = TrajectorySummary.of(t)
    return traj_refs, summaries


def _gather(refs: list[Any], progress: bool, desc: str) -> list[TrajectorySummary | None]:
    """Summaries as they finish (a progress bar on stderr); None where the worker died for good."""
    from tqdm import tqdm

    out: list[TrajectorySummary | None] = [None] * len(refs)
    index = {r: i for i, r in enumerate(refs)}
    pending = list(refs)
    with tqdm(total=len(refs), desc=desc, leave=False, disable=not progress, file=sys.stderr) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=None)
            for r in done:
                try:
                    out[index[r]] = ray.get(r)
                except ray.exceptions.RayActorError:
                    out[index[r]] = None
                bar.update(1)
    return out


def choose_transports(cfg: Config, learners: list[Any], rollouts: list[Any], feeders: list[list[int]],
                      infos: list[dict[str, Any]]) -> tuple[list[str], list[Any], str]:
    """Per engine, the transport from the learner ranks on its GPUs (`sync.transport`, `auto` resolved by where
    both landed: `jobs.placement.choose_engine_transport`) and, for vLLM Ray workers fed by CUDA IPC, the
    (rank, GPU uuid) of each worker; set on the engine and logged. Also the collective routes' backend (nccl
    when learners and engines are on GPUs, else gloo)."""
    from jobs.placement import choose_engine_transport  # noqa: PLC0415 (the actors' modules: not at jobs.cluster's import)

    wheres = ray.get([rank.device_where.remote() for rank in learners])
    transports, per_gpu = [], []
    for i, (info, ranks) in enumerate(zip(infos, feeders)):
        transport, why, shards = choose_engine_transport(cfg.sync.transport, {r: wheres[r] for r in ranks}, info)
        fed_by = ", ".join(f"learner-{r}" for r, _ in shards) if shards else f"learner-{ranks[0]}"
        print(f"rlsys: weights {fed_by} -> rollout-{i}: {transport} ({why})", flush=True)
        transports.append(transport)
        per_gpu.append(shards)
    ray.get([rollout.set_transport.remote(t) for rollout, t in zip(rollouts, transports)])
    on_gpus = all(w["on_gpu"] for w in wheres) and all(info.get("on_gpu") for info in infos)
    return transports, per_gpu, "nccl" if on_gpus else "gloo"


AWAKE_DEVICE_SHARE = 0.9  # `rollout.keep_awake = auto`: vLLM's share + the learner's peak within this of the GPU


def choose_sleep_level(cfg: Config, model_path: str, infos: list[dict[str, Any]]) -> tuple[int, str]:
    """The engines' sleep level between rollout and training and why: `rollout.keep_awake` as set, or for `auto`
    awake (0) when every engine is on a GPU and vLLM's share plus the learner's estimated peak fit within
    AWAKE_DEVICE_SHARE of the device (always true under `rollout.gpu_memory_budget_gib`, which caps both)."""
    from rlsys.memory import GIB, MemoryBudgetError, budget_split, job_estimate

    r = cfg.rollout
    if r.keep_awake != "auto":
        return cfg.sleep_level(), f"rollout.keep_awake={str(r.keep_awake).lower()}"
    if r.drop_rollout_state:
        return cfg.sleep_level(), "rollout.drop_rollout_state"
    if not all(i.get("on_gpu") and i.get("device_bytes") and i.get("engine_bytes") for i in infos):
        return cfg.sleep_level(), "keep_awake auto: engines not on a GPU"
    device = min(i["device_bytes"] for i in infos)
    engine = max(i["engine_bytes"] for i in infos)  # what each engine was given (actors/rollout.py)
    try:
        split = budget_split(cfg, model_path)
        if split is not None:
            return cfg.sleep_level(awake_fits=True), (
                f"keep_awake auto: the {r.gpu_memory_budget_gib:g} GiB budget caps vLLM and the learner side by side")
        learner = job_estimate(cfg, model_path).learner_bytes
    except (MemoryBudgetError, OSError, KeyError, ValueError) as err:  # no estimate for this model: play safe
        first = str(err).splitlines()[0] if str(err) else ""
        return cfg.sleep_level(), f"keep_awake auto: no memory estimate ({type(err).__name__}: {first})"
    need = learner + engine
    fits = need <= AWAKE_DEVICE_SHARE * device
    return cfg.sleep_level(awake_fits=fits), (
        f"keep_awake auto: vLLM {engine / GIB:.1f} GiB + learner ~{learner / GIB:.1f} GiB estimated "
        f"{'within' if fits else 'over'} {AWAKE_DEVICE_SHARE:.0%} of {device / GIB:.1f} GiB")


def canary_sequence(model_path: str) -> tuple[list[int], list[int]]:
    """A fixed chat (prompt ids, answer ids) whose logprobs engine and learner must agree on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "system", "content": "You play tic-tac-toe as X."},
                {"role": "user", "content": "X|2|O\n4|X|6\n7|8|O\nYour move."}]
    answer = '<tool_call>\n{"name": "choose_square", "arguments": {"square": 9}}\n</tool_call>'
    prompt = _ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    full = _ids(tok.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=True))
    if full[: len(prompt)] != prompt:  # templates that rewrite history: fall back to plain encoding
        full = prompt + tok.encode(answer, add_special_tokens=False)
    continuation = full[len(prompt) :][:32]
    if not continuation:
        raise RuntimeError(f"canary: the chat template of {model_path} rendered an empty answer")
    return prompt, continuation


def _ids(rendered: Any) -> list[int]:
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    return [int(i) for i in rendered]
