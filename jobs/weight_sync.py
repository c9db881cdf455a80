"""Weights from the learner ranks to the rollout engines (`WeightSync.push`), by routes planned once at job start
(`route_weights`: rlsys/weights/routes.py's plan, each side given its transports), and the stale-weights canary
that checks every push landed (`WeightSync.check_canary`).

The canary is a fixed chat unrelated to any environment (`canary_sequence`) whose logprobs the engines and the learner must agree on
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

    Every side holds the transports it was given at job start (`route_weights`: each learner rank those it exports
    by, each engine its route's), so a push names none: each feeding rank exports one payload per transport, sends
    what travels beside them (a collective route's broadcasts), and each engine loads the payloads of the ranks that
    feed it (`feeds`, from the route plan: usually the one rank on its GPU or node; all ranks hold the same weights, so
    any rank is a correct source; vLLM Ray workers fed by CUDA IPC take every worker's rank's at once)."""

    learners: list[Any]
    engines: list[Any]
    feeds: list[list[tuple[int, int]]]  # (E,) per engine: (learner rank, index of its transport) of each payload
    expected_count: int
    canary_prompt: list[int]
    canary_continuation: list[int]
    canary_tol: float
    canary_enabled: bool = True
    canary_every: int = 1  # check after every N-th push (the check at start always runs)
    # after every push, the engines' bit sums of what the push wrote against the learner's of what it sent
    # (rlsys/weights/fingerprint.py); a push an engine cannot fingerprint gets the logprob canary instead
    fingerprint: bool = True
    # the engines must move as far as the learner between checks (`canary_movement`): only where both compute in
    # the same numerics; fp32 masters move in steps below bf16's resolution that the pushed bf16 weights round away
    canary_follow: bool = True
    routes: tuple[Any, ...] = ()  # (E,) each engine's `EngineRoute` as planned (`route_weights`), for logs and tests
    _canary_calls: int = field(default=0, repr=False)
    # the last check's logprobs: (T,) the learner's and (E, T) the engines'
    _canary_last: tuple[list[float], list[list[float]]] | None = field(default=None, repr=False)

    @property
    def learner(self) -> Any:
        return self.learners[0]

    def push(self) -> dict[str, float]:
        """Wake the engines' weights (not their KV cache), load the learners' weights, check the count."""
        exports = self._exports()  # the learners pack while the engines map their weight memory back
        ray.get([e.wake.remote(["weights"]) for e in self.engines])
        sends = [self.learners[r].send_weights.remote() for r in exports]  # met by the engines' loads
        counts = ray.get([e.load_weights.remote(*[exports[r][k] for r, k in feed])
                          for e, feed in zip(self.engines, self.feeds)])
        ray.get(sends)
        ray.get([self.learners[r].ipc_collect.remote() for r in exports])  # the engines answered: IPC memory they
        # released can go (a no-op without CUDA)
        for i, count in enumerate(counts):
            if count != self.expected_count:
                raise RuntimeError(f"weight push: engine {i} loaded {count} tensors, the learner sent "
                                   f"{self.expected_count}; refusing to roll out with partly stale weights")
        return {"sync/tensors": float(self.expected_count)}

    def _exports(self) -> dict[int, list[Any]]:
        """Feeding rank -> the refs of its payloads, one per transport it was given."""
        links: dict[int, int] = {}
        for feed in self.feeds:
            for r, k in feed:
                links[r] = max(links.get(r, 0), k + 1)
        exports = {}
        for r, n in sorted(links.items()):
            export = self.learners[r].export_weights
            exports[r] = [export.remote()] if n == 1 else list(export.options(num_returns=n).remote())
        return exports

    def check_canary(self) -> dict[str, float]:
        """The stale-weights alarm, after every push (and once at the start). First the fingerprint (after a push,
        with `sync.fingerprint`): each engine's exact bit sums of what the push wrote must equal the learner's of
        what it sent, or the step fails naming the tensors that differ. Then the canary: the engines' logprobs on
        a fixed sequence against the learner's (all scored at once: different processes), which also checks the
        numerics the bits cannot (the engine computing from them as the learner does); with `sync.canary_every` N
        > 1 every N-th call after the first, and whenever a push went unfingerprinted. Also reports the engines'
        mean logprob on it and, from the second check on, `sync/canary_engine_shift`: how far the pushes since
        the last check moved the engine that moved least (0.0 for one that kept its old weights)."""
        calls, self._canary_calls = self._canary_calls, self._canary_calls + 1
        out = self._check_fingerprints() if self.fingerprint and calls else {}
        # with the fingerprint on, a push it could not check gets the canary whether due or not
        checked = not self.fingerprint or out.get("sync/fingerprinted") == 1.0
        if not self.canary_enabled or (calls % self.canary_every and checked):
            return out
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
        out.update({"sync/canary_logp_diff": worst, "sync/canary_logp_mean": sum(scores[0]) / max(len(scores[0]), 1)})
        if self._canary_last is not None:
            out.update(canary_movement(self._canary_last, ref, scores, enforce=self.canary_follow))
        self._canary_last = ref, scores
        return out

    def _check_fingerprints(self) -> dict[str, float]:
        """Every engine's bit sums against those of a learner rank that fed this push (all ranks hold the same
        weights); raises on a difference. {"sync/fingerprinted": 1.0} when every engine was checked, else 0.0."""
        from rlsys.weights.fingerprint import differing  # noqa: PLC0415 (rlsys.weights imports torch)

        source = self.feeds[0][0][0] if self.feeds and self.feeds[0] else 0
        ref, *held = ray.get([self.learners[source].weights_fingerprint.remote(),
                              *[e.weights_fingerprint.remote() for e in self.engines]])
        if ref is None:
            return {"sync/fingerprinted": 0.0}
        checked = 0
        for i, sums in enumerate(held):
            if sums is None:  # this engine cannot tell (no copy plan, tensor parallel, dropped weights)
                continue
            bad = differing(ref, sums)
            if bad:
                raise RuntimeError(
                    f"weight fingerprint: engine {i} holds {len(bad)} of the {len(ref)} pushed tensors with other "
                    f"bits than the learner sent, e.g. {bad[:3]}: the weight push was skipped or partly lost "
                    "(or the engine keeps another dtype than the learner sends)")
            checked += 1
        return {"sync/fingerprinted": float(checked == len(held))}


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
                  infos: list[dict[str, Any]], bucket_bytes: int,
                  collective_timeout_s: float | None = None) -> RoutePlan:
    """The job's weight routes, decided once: where each learner rank's weights live (`Learner.device_where`) and
    what each engine reported (``infos``) into `plan_routes` (``requested``: `sync.transport`), a group per source
    rank of collective routes (hosted at the rank's address); each route is logged and given to both sides, the
    engine (`set_route`) and the learner ranks that feed it (`open_transports`), before the first push."""
    from rlsys.weights.routes import plan_routes  # noqa: PLC0415 (rlsys.weights imports torch: not at import)
    from rlsys.weights.transport import make_transport  # noqa: PLC0415

    wheres = ray.get([rank.device_where.remote() for rank in learners])
    plan = plan_routes(requested, wheres, feeders, infos)
    sources = plan.collective_sources()
    addresses = dict(zip(sources, ray.get([learners[r].address.remote() for r in sources])))
    plan = plan.with_groups(addresses, collective_timeout_s)
    for i, route in enumerate(plan.routes):
        print(f"rlsys: weights {route.fed_by()} -> rollout-{i}: {route.transport} ({route.why})", flush=True)
    ray.get([rollout.set_route.remote(route) for rollout, route in zip(rollouts, plan.routes)]
            + [rank.open_transports.remote([make_transport(name, plan.group_of(r)) for name in plan.transports_of(r)],
                                           bucket_bytes) for r, rank in enumerate(learners)])
    return plan


def canary_sequence(model_path: str) -> tuple[list[int], list[int]]:
    """A fixed chat (prompt ids, answer ids) whose logprobs engine and learner must agree on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Name three primary colours, then count to five."}]
    answer = "Red, yellow and blue. One, two, three, four, five."
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
