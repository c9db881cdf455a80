"""The rollout engines as one group, and how deeply they sleep while the learner trains.

Sleep level 0 keeps vLLM awake (its KV cache stays), 1 offloads its weights and drops the KV cache, 2 drops both;
`choose_sleep_level` picks it from `rollout.keep_awake` and, for `auto`, from the memory estimate (rlsys/memory.py).
"""
from __future__ import annotations

from typing import Any

import ray

from rlsys.config import Config


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



AWAKE_DEVICE_SHARE = 0.9  # `rollout.keep_awake = auto`: vLLM's share + the learner's peak within this of the GPU


def choose_sleep_level(cfg: Config, model_path: str, infos: list[dict[str, Any]]) -> tuple[int, str]:
    """The engines' sleep level between rollout and training and why: `rollout.keep_awake` as set, or for `auto`
    awake (0) when every engine is on a GPU and vLLM's share plus the learner's estimated peak fit within
    AWAKE_DEVICE_SHARE of the device (always true under `rollout.gpu_memory_budget_gib`, which caps both).
    Awake by request (`keep_awake = true`, `overlap`) where the estimate says they do not fit: awake all the same,
    and the reason says so (the job may then run out of GPU memory at its first update)."""
    r = cfg.rollout
    if r.overlap or r.keep_awake is True:
        asked = ("rollout.overlap: the engines sample the next batch while the learner trains" if r.overlap
                 else "rollout.keep_awake=true")
        fits, estimate = _awake_fits(cfg, model_path, infos)
        if fits is False:
            asked += (f"; WARNING {estimate}: the first update may run out of GPU memory (lower "
                      "rollout.gpu_memory_utilization or kv_cache_gib, or set a gpu_memory_budget_gib)")
        return cfg.sleep_level(), asked  # 0: the config's one rule for both
    if r.keep_awake != "auto":
        return cfg.sleep_level(), f"rollout.keep_awake={str(r.keep_awake).lower()}"
    if r.drop_rollout_state:
        return cfg.sleep_level(), "rollout.drop_rollout_state"
    fits, estimate = _awake_fits(cfg, model_path, infos)
    return cfg.sleep_level(awake_fits=bool(fits)), f"keep_awake auto: {estimate}"


def _awake_fits(cfg: Config, model_path: str, infos: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """Whether vLLM's share and the learner's estimated peak fit side by side (None: unknown), and the figures."""
    from rlsys.budget import budget_split, job_estimate
    from rlsys.memory import GIB, LORA_KEPT, MemoryBudgetError

    r = cfg.rollout
    if not all(i.get("on_gpu") and i.get("device_bytes") and i.get("engine_bytes") for i in infos):
        return None, "engines not on a GPU"
    device = min(i["device_bytes"] for i in infos)
    engine = max(i["engine_bytes"] for i in infos)  # what each engine was given (actors/rollout.py)
    try:
        if budget_split(cfg, model_path) is not None:
            return True, f"the {r.gpu_memory_budget_gib:g} GiB budget caps vLLM and the learner side by side"
        estimate = job_estimate(cfg, model_path)
        # learner.lora: the engine process also holds the targets' kept base copy, beside vLLM's share
        learner, kept = estimate.learner_bytes, estimate.engine.get(LORA_KEPT, 0)
    except (MemoryBudgetError, OSError, KeyError, ValueError) as err:  # no estimate for this model: play safe
        first = str(err).splitlines()[0] if str(err) else ""
        return None, f"no memory estimate ({type(err).__name__}: {first})"
    fits = learner + engine + kept <= AWAKE_DEVICE_SHARE * device
    lora = f" + LoRA's kept base copy {kept / GIB:.1f} GiB" if kept else ""
    return fits, (f"vLLM {engine / GIB:.1f} GiB{lora} + learner ~{learner / GIB:.1f} GiB estimated "
                  f"{'within' if fits else 'over'} {AWAKE_DEVICE_SHARE:.0%} of {device / GIB:.1f} GiB")
