"""The weight route per engine, decided once when the job starts: which transport carries the learner's weights to
each engine, and from which learner rank(s).

`plan_routes` is pure: from the requested `sync.transport`, where each learner rank's weights live
(`Learner.device_where`) and what each engine reports (`RolloutWorker.start`: its node, Ray's GPU ids, vLLM's
workers), it returns one `EngineRoute` per engine and the collective routes' backend; `RoutePlan.with_groups` then
names each collective route's group (its source rank's address). The driver gives each engine its route
(`RolloutWorker.set_route`, which makes the engine's transport from it) and each learner rank the transports it
exports by (`Learner.open_transports`, in `RoutePlan.transports_of` order) before the first push; `jobs.weight_sync.
WeightSync` then pushes along `RoutePlan.feeds` without naming a transport. `auto` is resolved here and only here:
CUDA IPC where learner and engine share a GPU, a collective broadcast (NCCL) between GPUs, the Ray object store
otherwise.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlsys.errors import UserInputError


@dataclass(frozen=True)
class EngineRoute:
    """How weights reach one engine."""

    transport: str  # "cuda_ipc", "collective" or "object_store"
    source: int  # the learner rank that feeds it (the first on its GPUs)
    why: str  # the placement fact that decided it, for the start-up log
    # vLLM Ray workers fed by CUDA IPC: (learner rank, GPU uuid) per worker, each worker opening its GPU's handles
    per_gpu: tuple[tuple[int, str], ...] | None = None
    group: Any = None  # collective: the source rank's group (a rlsys.weights.collective.CollectiveRoute)
    group_rank: int = 0  # collective: this engine's rank in it (1..)

    def ranks(self) -> list[int]:
        """The learner ranks whose payloads the engine loads, in the order it takes them."""
        return [r for r, _ in self.per_gpu] if self.per_gpu else [self.source]

    def fed_by(self) -> str:
        """The learner ranks whose payloads the engine loads, as the log names them."""
        return ", ".join(f"learner-{r}" for r in self.ranks())


@dataclass(frozen=True)
class RoutePlan:
    """Every engine's route, and the backend of the collective routes among them."""

    routes: tuple[EngineRoute, ...]  # (E,)
    collective_backend: str  # "nccl" when learners and engines are all on GPUs, else "gloo"

    def transports_of(self, rank: int) -> list[str]:
        """The transports learner rank ``rank`` exports by (sorted; none if it feeds no engine)."""
        return sorted({route.transport for route in self.routes if rank in route.ranks()})

    def group_of(self, rank: int) -> Any:
        """The collective group learner rank ``rank`` broadcasts to (`with_groups`), or None."""
        return next((route.group for route in self.routes if route.group is not None and route.source == rank), None)

    def feeds(self) -> list[list[tuple[int, int]]]:
        """(E,) for each engine, the payloads it loads: (learner rank, index into that rank's `transports_of`)."""
        return [[(r, self.transports_of(r).index(route.transport)) for r in route.ranks()] for route in self.routes]

    def with_groups(self, addresses: dict[int, tuple[str, int]], timeout_s: float | None = None) -> RoutePlan:
        """The plan with a group per source rank of collective routes: the rank (group rank 0) hosts the rendezvous
        at ``addresses[rank]`` (its node IP and a free port), its engines are ranks 1.. in engine order."""
        from rlsys.weights.collective import CollectiveRoute  # noqa: PLC0415 (torch; the plan itself is pure)

        fed: dict[int, list[int]] = {}
        for i, route in enumerate(self.routes):
            if route.transport == "collective":
                fed.setdefault(route.source, []).append(i)
        routes = list(self.routes)
        for rank, engines in sorted(fed.items()):
            host, port = addresses[rank]
            group = CollectiveRoute(name=f"learner-{rank} -> " + ", ".join(f"rollout-{i}" for i in engines),
                                    host=host, port=port, world_size=1 + len(engines), backend=self.collective_backend,
                                    **({} if timeout_s is None else {"timeout_s": timeout_s}))
            for k, i in enumerate(engines):
                routes[i] = dataclasses.replace(routes[i], group=group, group_rank=k + 1)
        return dataclasses.replace(self, routes=tuple(routes))

    def collective_sources(self) -> list[int]:
        """The learner ranks that feed an engine by a collective route (they host its rendezvous)."""
        return sorted({route.source for route in self.routes if route.transport == "collective"})


def plan_routes(requested: str, learners: list[dict[str, Any]], feeders: list[list[int]],
                engines: list[dict[str, Any]]) -> RoutePlan:
    """The route of engine i from the learner ranks on its GPUs (``feeders[i]``; ``learners[r]``: where rank r's
    weights live) and what the engine reported (``engines[i]``), by `choose_engine_transport`. Raises
    UserInputError for a transport the placement cannot honour (cuda_ipc across GPUs, collective on one GPU)."""
    routes = []
    for ranks, engine in zip(feeders, engines):
        transport, why, per_gpu = choose_engine_transport(requested, {r: learners[r] for r in ranks}, engine)
        routes.append(EngineRoute(transport=transport, source=ranks[0], why=why,
                                  per_gpu=tuple(per_gpu) if per_gpu else None))
    on_gpus = all(w["on_gpu"] for w in learners) and all(e.get("on_gpu") for e in engines)
    return RoutePlan(routes=tuple(routes), collective_backend="nccl" if on_gpus else "gloo")


def choose_transport(requested: str, learner: dict[str, Any], engine: dict[str, Any]) -> tuple[str, str]:
    """(transport, why) for one engine fed by one learner rank. ``learner`` / ``engine``: where the weights
    live, {"node_id", "gpu_ids" (Ray's), "on_gpu"} (`Learner.device_where`, `RolloutWorker.start`).

    `auto`: both on GPUs and on the same one (same node, same single GPU id) -> cuda_ipc; both on GPUs
    elsewhere (another GPU or node) -> collective (NCCL broadcast); otherwise (CPU, or a CPU engine) ->
    object_store. An explicit `cuda_ipc` falls back to object_store without GPUs (as the CPU layout always did)
    and is refused for learner and engine on different GPUs, here rather than at the first push.
    """
    on_gpus = bool(learner.get("on_gpu")) and bool(engine.get("on_gpu"))
    same_node = learner.get("node_id") == engine.get("node_id")
    if learner.get("gpu_uuid") and engine.get("gpu_uuid"):  # the physical GPU, whatever each process calls it
        same_gpu = on_gpus and same_node and learner["gpu_uuid"] == engine["gpu_uuid"]
    else:
        gpus = list(learner.get("gpu_ids") or [])
        same_gpu = on_gpus and same_node and len(gpus) == 1 and gpus == list(engine.get("gpu_ids") or [])
    where = ("the same GPU" if same_gpu else "different GPUs on one node" if on_gpus and same_node
             else "different nodes" if on_gpus else "CPU (learner or engine not on a GPU)")
    if requested == "auto":
        if same_gpu:
            return "cuda_ipc", where
        return ("collective", where + ": NCCL broadcast") if on_gpus else ("object_store", where)
    if requested == "cuda_ipc" and not on_gpus:  # as before: the CPU layout has no CUDA to share
        return "object_store", f"{where}: cuda_ipc needs CUDA, weights go through the object store"
    if requested == "cuda_ipc" and not same_gpu:
        raise UserInputError(f"sync.transport=cuda_ipc needs learner and engine on one GPU, but they are on {where}; "
                             "use auto (chooses collective or object_store) or collective")
    if requested == "collective" and same_gpu:  # NCCL refuses two ranks on one device ("Duplicate GPU detected")
        raise UserInputError("sync.transport=collective broadcasts between GPUs, but learner and engine share one "
                             "GPU; use auto (cuda_ipc there) or cuda_ipc")
    backend = " (nccl)" if on_gpus else " (gloo)"
    return requested, f"{where}, as configured" + (backend if requested == "collective" else "")


def choose_engine_transport(requested: str, feeders: dict[int, dict[str, Any]],
                            engine: dict[str, Any]) -> tuple[str, str, list[tuple[int, str]] | None]:
    """(transport, why, per_gpu) for one engine fed by the learner ranks on its GPUs (``feeders``: rank ->
    `Learner.device_where`; ``engine``: `RolloutWorker.start`'s answer). One worker in the engine's own
    process (tp_size 1, or a CPU engine): `choose_transport` for it and the first feeder, per_gpu None. vLLM's
    Ray executor: each worker is matched with the rank on its GPU; all matched -> cuda_ipc with per_gpu =
    [(rank, GPU uuid)] per worker (a `PerGpuPayload`); a one-worker engine elsewhere -> `choose_transport`; a
    tensor-parallel engine elsewhere -> the object store (every worker loads the whole CPU buckets; a NCCL
    route would need a group rank per worker, not built), and an explicit cuda_ipc or collective is refused."""
    first = min(feeders)
    workers = [{"node_id": w.get("node_id"), "on_gpu": True, "gpu_uuid": w.get("gpu_uuid")}
               for w in engine.get("workers") or []]
    if not engine.get("ray_executor"):
        return (*choose_transport(requested, feeders[first], workers[0] if workers else engine), None)
    matched = [next((r for r, f in sorted(feeders.items()) if f.get("on_gpu") and f.get("gpu_uuid") == w["gpu_uuid"]
                     and f.get("node_id") == w["node_id"]), None) for w in workers]
    if workers and None not in matched and requested in ("auto", "cuda_ipc"):
        return "cuda_ipc", f"{len(workers)} vLLM Ray worker(s), each on a learner rank's GPU", [
            (r, w["gpu_uuid"]) for r, w in zip(matched, workers)]
    if len(workers) == 1:
        return (*choose_transport(requested, feeders[first], workers[0]), None)
    if requested == "object_store":
        return "object_store", f"{len(workers)} tensor-parallel workers, as configured", None
    if requested in ("cuda_ipc", "collective"):
        raise UserInputError(f"sync.transport={requested}: the {len(workers)} workers of a tensor-parallel engine are "
                             "not each on a learner rank's GPU (cuda_ipc), and NCCL routes to tensor-parallel "
                             "workers are not built; use auto (the object store)")
    return "object_store", f"{len(workers)} tensor-parallel workers not each on a learner rank's GPU", None
