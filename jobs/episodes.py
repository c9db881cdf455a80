"""Episodes and their fan-out: every (item, sample) on the env workers, spread over the engines, gathered as they
finish; and the prompt variants that evaluation runs every item under.

Training (`Job.rollout`), the training job's evaluations and `rlsys eval` all submit episodes through `run_episodes`.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import ray

from rlsys.envs.base import DEFAULT_VARIANT, Perturbation
from rlsys.types import Trajectory, TrajectorySummary

def with_variants(items: list[dict[str, Any]], variants: list[str],
                  perturbations: Mapping[str, Perturbation]) -> list[tuple[str, dict[str, Any]]]:
    """(variant, item) for every variant and the items it runs: ``items`` for the default prompt, what the
    environment's perturbation makes of them for another (it may leave out items it does not apply to)."""
    return [(v, item) for v in variants for item in (items if v == DEFAULT_VARIANT else perturbations[v](items))]


EPISODES_PER_CALL = 64  # a worker's episodes travel in Ray calls of at most this many (the progress bar's unit)


def agent_calls(session_id: Callable[[int, int], str]) -> Callable[..., list[tuple[Any, Any]]]:
    """``run_episodes``' ``submit`` for agent episodes: one `EnvWorker.run_episodes` call for a batch, episode
    (g, s) under the session id ``session_id(g, s)``."""
    def submit(worker: Any, proxy: dict[str, Any], episodes: list[tuple[dict[str, Any], int, int]]):
        return _pairs(worker.run_episodes.options(num_returns=2 * len(episodes)).remote(
            proxy, [(item, g, s, session_id(g, s)) for item, g, s in episodes]))

    return submit


def sft_calls(model_path: str) -> Callable[..., list[tuple[Any, Any]]]:
    """``run_episodes``' ``submit`` for SFT examples (`EnvWorker.sft_examples`, rendered, not sampled)."""
    def submit(worker: Any, proxy: dict[str, Any], episodes: list[tuple[dict[str, Any], int, int]]):
        return _pairs(worker.sft_examples.options(num_returns=2 * len(episodes)).remote(episodes, model_path))

    return submit


def _pairs(refs: list[Any]) -> list[tuple[Any, Any]]:
    """A batch call's returns (trajectory, summary, trajectory, ...) as (trajectory, summary) pairs."""
    return list(zip(refs[0::2], refs[1::2]))


def run_episodes(env_workers: list[Any], proxies: list[dict[str, Any]], items: list[dict[str, Any]], n: int,
                 submit, progress: bool = False, desc: str = "rollout", first_group: int = 0,
                 generates: bool = True) -> tuple[list[Any], list[TrajectorySummary]]:
    """``n`` episodes of every item on the env workers: ``submit(worker, proxy, episodes)`` starts a list of
    (item, group, sample) on one worker (`agent_calls`, `sft_calls`) and returns their (trajectory, summary) refs;
    item i is group ``first_group + i``. Returns the trajectory refs and the summaries, in item-major order.
    ``generates``: the episodes call the engines (False: SFT examples, which are rendered, not sampled, so no
    wave is announced).

    Engines take episodes in turn, each on an env worker on its engine's node (worker i serves engine i mod E),
    and each worker gets its share in calls of at most ``EPISODES_PER_CALL`` episodes. An episode whose
    worker died twice comes back as a failed trajectory (`worker_died`), never as a hole."""
    engines = len(proxies)
    local_workers = [env_workers[e::engines] for e in range(engines)]
    # each engine hears how many episodes (first requests) come its way, before they do: the CPU engine batches
    # them together instead of starting on the first few (`Engine.expect`); vLLM ignores it
    total = len(items) * n
    if generates:
        ray.get([p["actor"].expect.remote(total // engines + (e < total % engines))
                 for e, p in enumerate(proxies) if p.get("actor") is not None])
    keys = [(item, g, s) for g, item in enumerate(items, first_group) for s in range(n)]
    shares: dict[tuple[int, int], list[int]] = {}  # (engine, worker) -> episode indices
    for k in range(total):
        e = k % engines
        shares.setdefault((e, (k // engines) % len(local_workers[e])), []).append(k)
    traj_refs: list[Any] = [None] * total
    summary_refs: list[Any] = [None] * total
    for (e, w), share in shares.items():
        for c in range(0, len(share), EPISODES_PER_CALL):
            chunk = share[c:c + EPISODES_PER_CALL]
            for k, (t_ref, s_ref) in zip(chunk, submit(local_workers[e][w], proxies[e], [keys[k] for k in chunk]),
                                         strict=True):
                traj_refs[k], summary_refs[k] = t_ref, s_ref
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
