"""Episodes and their fan-out: every (item, sample) on the env workers, spread over the engines, gathered as they
finish; and the prompt variants that evaluation runs every item under.

Training (`Job.rollout`), the training job's evaluations and `rlsys eval` all submit episodes through `run_episodes`.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import ray

from rlsys.envs.base import DEFAULT_VARIANT, Perturbation
from rlsys.types import Trajectory, TrajectorySummary

def with_variants(items: list[dict[str, Any]], variants: list[str],
                  perturbations: Mapping[str, Perturbation]) -> list[tuple[str, dict[str, Any]]]:
    """(variant, item) for every variant and the items it runs: ``items`` for the default prompt, what the
    environment's perturbation makes of them for another (it may leave out items it does not apply to)."""
    return [(v, item) for v in variants for item in (items if v == DEFAULT_VARIANT else perturbations[v](items))]


def run_episodes(env_workers: list[Any], proxies: list[dict[str, Any]], items: list[dict[str, Any]], n: int,
                 submit, progress: bool = False, desc: str = "rollout", first_group: int = 0,
                 generates: bool = True) -> tuple[list[Any], list[TrajectorySummary]]:
    """``n`` episodes of every item on the env workers: ``submit(worker, proxy, item, group, sample)`` returns
    the (trajectory, summary) refs of one; item i is group ``first_group + i``. Returns the trajectory refs and
    the summaries, in item-major order. ``generates``: the episodes call the engines (False: SFT examples, which
    are rendered, not sampled, so no wave is announced).

    Engines take episodes in turn (all are submitted at once, so turn order = least loaded), each on an env
    worker on its engine's node (worker i serves engine i mod E). An episode whose worker died twice comes
    back as a failed trajectory (`worker_died`), never as a hole."""
    traj_refs, summary_refs, keys = [], [], []
    engines = len(proxies)
    local_workers = [env_workers[e::engines] for e in range(engines)]
    # each engine hears how many episodes (first requests) come its way, before they do: the CPU engine batches
    # them together instead of starting on the first few (`Engine.expect`); vLLM ignores it
    total = len(items) * n
    if generates:
        ray.get([p["actor"].expect.remote(total // engines + (e < total % engines))
                 for e, p in enumerate(proxies) if p.get("actor") is not None])
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
