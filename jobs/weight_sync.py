"""Weights from the learner ranks to the rollout engines (`WeightSync.push`), by routes planned once at job start
(`route_weights`: rlsys/weights/routes.py's plan, given to both sides), and the stale-weights canary that checks
every push landed (`WeightSync.check_canary`).

The canary is a fixed tic-tac-toe chat (`canary_sequence`) whose logprobs the engines and the learner must agree on
within a tolerance (jobs/placement.py `canary_tolerance`), and, between checks, move together (`canary_movement`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from rlsys.weights.routes import RoutePlan


@dataclass
class WeightSync:
    """Learners -> engines, behind one call (`push`), then the canary (`check_canary`).

    Engine i is fed by learner rank `sources[i]`, the rank on its GPU (or node), by the transport the placement
    chose for that pair (rlsys/weights/routes.py `plan_routes`); all ranks hold the same weights, so any rank
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



def route_weights(requested: str, learners: list[Any], rollouts: list[Any], feeders: list[list[int]],
                  infos: list[dict[str, Any]]) -> RoutePlan:
    """The job's weight routes, decided once: where each learner rank's weights live (`Learner.device_where`) and
    what each engine reported (``infos``) into `plan_routes` (``requested``: `sync.transport`); each route is
    logged and given to both sides, the engine (`set_route`) and the learner ranks that feed it
    (`open_transports`), before the first push."""
    from rlsys.weights.routes import plan_routes  # noqa: PLC0415 (rlsys.weights imports torch: not at import)

    wheres = ray.get([rank.device_where.remote() for rank in learners])
    plan = plan_routes(requested, wheres, feeders, infos)
    for i, route in enumerate(plan.routes):
        print(f"rlsys: weights {route.fed_by()} -> rollout-{i}: {route.transport} ({route.why})", flush=True)
    ray.get([rollout.set_route.remote(route) for rollout, route in zip(rollouts, plan.routes)]
            + [rank.open_transports.remote(plan.transports_of(r)) for r, rank in enumerate(learners)])
    return plan


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
