"""Held-out evaluation of a checkpoint: `rlsys eval --ckpt PATH` (or `python -m jobs.eval --ckpt PATH`).

The same actors and agent path as training, minus the learner: one rollout actor (engine + OpenAI proxy)
and the env workers of `jobs.placement.make_env_workers`, each episode an agent run through the proxy,
scored by the job's reward and labelled by its `outcome`. Greedy by default (`--temperature 0`).

Items: `--items FILE` (JSONL; `--boards` is the old name), else the environment's held-out items
(`jobs.items.load_eval_items`; generated ones are disjoint from the training set). When `--ckpt` is a checkpoint
written by rlsys, its `config.resolved.toml` supplies the environment and the data seeds, so the held-out set is
disjoint from *that run's* training set (and the agent, reward and max_new_tokens are the run's own).

`--perturb` runs the held-out items once more per perturbation of the environment (`Environment.perturbations`:
each makes its variant's items from the held-out ones, e.g. tagged with `"prompt_variant"` for the agent to read).
Each variant is reported on its own (rates, reward, error table), next to the unperturbed `default`.

Rates come from the environment's `summarize(items, outcomes)` (rates over all items, then any split by kind of
item, with `<kind>_episodes` counts); failed episodes (agent or reward errors) count in the denominator and appear
in the error table under their failure kind, never as a 0 reward.
`evaluate_held_out` runs the episodes and computes these per variant, here and for the training job's evaluations
(`Job.evaluate`): one evaluation path.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlsys.config import Config, DataConfig, EnvConfig, load_config
from rlsys.envs.base import DEFAULT_VARIANT, Environment
from rlsys.errors import UserInputError

EXAMPLES_PER_VARIANT = 3
REPORT_KEYS = ("episodes", "rewards_mean", "failed_frac", "response_len_mean", "errors", "episode")  # the rest: rates


@dataclass
class EvalRequest:
    """What `rlsys eval` was asked for (the command line, typed)."""

    ckpt: str = "rlsys:tiny"
    items: str | None = None  # JSONL of held-out items; None = the environment's held-out items
    perturb: bool = False
    n: int | None = None  # evaluate the first n items only
    samples: int = 1  # episodes per item (and variant)
    temperature: float = 0.0
    config: str | None = None  # TOML file to start from (else the checkpoint's own resolved config)
    overrides: list[str] = field(default_factory=list)


# --- what to evaluate ------------------------------------------------------------------------------
def resolve_ckpt(path: str) -> str:
    """A model folder as is; a run directory or a checkpoints folder -> its latest complete checkpoint."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / "config.json").is_file():
        return path
    for root in (p, p / "checkpoints"):
        latest = root / "latest"
        if latest.is_file() and (root / latest.read_text().strip() / "config.json").is_file():
            return str(root / latest.read_text().strip())
    return path  # resolve_model will say what is wrong with it


def eval_config(req: EvalRequest) -> Config:
    """The config episodes run under: the checkpoint's resolved config (or `--config`), model = the ckpt."""
    ckpt = resolve_ckpt(req.ckpt)
    base = req.config
    own = Path(ckpt) / "config.resolved.toml"
    if base is None and own.is_file():
        base = str(own)
    overrides = [f"model.ckpt={json.dumps(ckpt)}"]
    if req.items:
        overrides.append(f"data.eval_path={json.dumps(req.items)}")
    return load_config(base, overrides=[*overrides, *req.overrides])


def eval_items(d: DataConfig, algo: str, env: Environment, n: int | None) -> tuple[list[dict[str, Any]], str]:
    """The held-out items (first ``n`` if given) and a one-line description of where they came from."""
    from jobs.items import load_eval_items

    items = load_eval_items(d, algo, env)
    source = d.eval_path or f"the {env.name} environment's held-out items (data seed {d.seed})"
    if n is not None:
        items = items[:n]
    return items, source


def eval_variants(env: Environment, perturb: bool) -> list[str]:
    """The variants to run: the default prompt, and with ``perturb`` every perturbation of the environment."""
    return [DEFAULT_VARIANT, *(env.perturbations if perturb else ())]


# --- running episodes on Ray actors ------------------------------------------------------------------
def start_actors(engine: Any, env: EnvConfig, model_path: str) -> tuple[Any, dict[str, Any], list[Any]]:
    """A rollout actor (engine + proxy, ``engine``: its `EngineSettings`; the whole GPU when there is one) and the
    env workers."""
    import ray

    from actors.rollout import RolloutWorker
    from jobs.placement import gpu_actor_env, make_env_workers

    token = secrets.token_urlsafe(24)
    if int(ray.cluster_resources().get("GPU", 0)):
        options = {"num_gpus": 1, "runtime_env": {"env_vars": gpu_actor_env()}}
        kwargs = {}
    else:
        options = {"num_gpus": 0}
        kwargs = {"num_threads": max(1, os.cpu_count() or 1)}
    rollout = ray.remote(RolloutWorker).options(name="rollout-0", num_cpus=0, max_concurrency=1024, **options).remote(
        engine, model_path, api_token=token, transport="object_store", **kwargs)
    info = ray.get(rollout.start.remote())
    # env workers on the engine's node, so agent traffic stays on loopback (as in training)
    return rollout, {**info, "actor": rollout}, make_env_workers(env, nodes=[info.get("node_id")])


# --- turning summaries into the report -------------------------------------------------------------------
def outcome_rates(env: Environment, items: list[dict[str, Any]], summaries: list[Any]) -> dict[str, float]:
    """The environment's rates over these episodes (``items[k]`` is episode k's item). A failed episode's outcome
    is "failed", so it counts against every rate. {} when the environment has no summary."""
    return env.rates(items, [s.outcome if not s.failed else "failed" for s in summaries])


@dataclass
class VariantResult:
    """One prompt variant's episodes, summed up."""

    episodes: int
    rollout: dict[str, float]  # `rollout_metrics` of its episodes: `rollout/<key>` and `error/<label>` keys
    rates: dict[str, float]  # `outcome_rates` of its episodes (a failed episode is a miss)

    def report(self) -> dict[str, Any]:
        """`rlsys eval`'s entry for the variant: episodes, rates, reward and the error table."""
        out: dict[str, Any] = {"episodes": self.episodes, **self.rates}
        for key in ("rewards_mean", "failed_frac", "response_len_mean"):
            if f"rollout/{key}" in self.rollout:
                out[key] = self.rollout[f"rollout/{key}"]
        out["errors"] = {k.removeprefix("error/"): v for k, v in self.rollout.items() if k.startswith("error/")}
        episode = {k.removeprefix("episode/"): v for k, v in self.rollout.items() if k.startswith("episode/")}
        if episode:
            out["episode"] = episode  # the environment's per-episode scalars, averaged
        return out

    def flat(self, prefix: str) -> dict[str, float]:
        """The training job's metrics: ``prefix`` + the rollout metrics (without `rollout/`), then the rates."""
        out = {prefix + (k.split("/", 1)[1] if k.startswith("rollout/") else k): x for k, x in self.rollout.items()}
        out.update({prefix + k: x for k, x in self.rates.items()})
        return out


@dataclass
class HeldOut:
    """An evaluation's episodes: ``episodes[k // samples]`` is episode k's (variant, item)."""

    episodes: list[tuple[str, dict[str, Any]]]
    samples: int
    traj_refs: list[Any]
    summaries: list[Any]
    variants: dict[str, VariantResult]


def evaluate_held_out(env_workers: list[Any], proxies: list[dict[str, Any]], items: list[dict[str, Any]],
                      variants: list[str], samples: int, env: Environment, tag: str | None = None,
                      progress: bool = False) -> HeldOut:
    """``samples`` episodes of every item under every variant (``env``'s perturbations), on the env workers behind
    ``proxies`` (the engines' temperature is the caller's to set), summed up per variant. Episode (g, s) runs with
    the seed `eval-<tag>-item<g>-sample<s>`, ``tag`` defaulting to the episode's variant. The one evaluation path
    of `rlsys eval` and of the training job's evaluations (`Job.evaluate`)."""
    from jobs.episodes import agent_calls, run_episodes, with_variants
    from rlsys.metrics import rollout_metrics

    episodes = with_variants(items, variants, env.perturbations)
    traj_refs, summaries = run_episodes(
        env_workers, proxies, [item for _, item in episodes], samples,
        agent_calls(lambda g, s: f"eval-{episodes[g][0] if tag is None else tag}-item{g}-sample{s}"),
        progress=progress, desc="eval")
    results = {}
    for v in variants:
        ks = [k for k in range(len(summaries)) if episodes[k // samples][0] == v]
        mine = [summaries[k] for k in ks]
        results[v] = VariantResult(episodes=len(mine), rollout=rollout_metrics(mine, env.outcomes),
                                   rates=outcome_rates(env, [episodes[k // samples][1] for k in ks], mine))
    return HeldOut(episodes=episodes, samples=samples, traj_refs=traj_refs, summaries=summaries, variants=results)


def collect_examples(traj_refs: list[Any], summaries: list[Any], episodes: list[tuple[str, dict[str, Any]]],
                     samples: int, by_outcome: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The first few episodes of each variant, with what the model answered (for the JSON report). ``by_outcome``:
    instead, the first few of each outcome (a failure by its kind) of the default variant, keyed by the outcome:
    what a person reads to see why answers fail. Pulls only the trajectories it returns."""
    import ray

    from rlsys.metrics import episode_label

    picked: dict[str, list[int]] = {}
    for k in range(len(traj_refs)):
        variant = episodes[k // samples][0]
        if by_outcome:
            if variant != DEFAULT_VARIANT:
                continue
            variant = episode_label(summaries[k])
        if len(picked.setdefault(variant, [])) < EXAMPLES_PER_VARIANT:
            picked[variant].append(k)
    flat = [k for ks in picked.values() for k in ks]
    trajs = dict(zip(flat, ray.get([traj_refs[k] for k in flat])))
    out: dict[str, list[dict[str, Any]]] = {}
    for variant, ks in picked.items():
        out[variant] = [{"item_id": trajs[k].item_id, "item": episodes[k // samples][1],
                         "outcome": trajs[k].outcome or None, "reward": trajs[k].reward if not trajs[k].failed else None,
                         "fail_reason": trajs[k].fail_reason or None, "output": trajs[k].info.get("output")}
                        for k in ks]
    return out


def run_eval(req: EvalRequest) -> dict[str, Any]:
    """Evaluate ``req.ckpt``; returns the report (what `--json` writes)."""
    import ray

    from jobs.session import init_ray
    from rlsys.models.resolve import resolve_model

    cfg = eval_config(req)
    env = cfg.env.environment()
    items, source = eval_items(cfg.data, cfg.algo.name, env, req.n)
    variants = eval_variants(env, req.perturb)
    if req.perturb and not env.perturbations:
        print(f"rlsys eval: WARNING --perturb: the environment {env.name} has no perturbations (another agent than "
              "its own has none); only the default prompt runs", file=sys.stderr, flush=True)
    model_path = resolve_model(cfg.model.ckpt)

    t0 = time.perf_counter()
    owns_ray = init_ray(cfg.cluster, f"rlsys-eval-{secrets.token_hex(4)}")
    rollout, env_workers = None, []
    try:
        from jobs.placement import engine_settings

        rollout, proxy, env_workers = start_actors(engine_settings(cfg, model_path), cfg.env, model_path)
        ray.get(rollout.set_temperature.remote(req.temperature))
        t_start = time.perf_counter()
        held_out = evaluate_held_out(env_workers, [proxy], items, variants, req.samples, env,
                                     progress=cfg.logging.progress)
        t_episodes = time.perf_counter() - t_start
        examples = collect_examples(held_out.traj_refs, held_out.summaries, held_out.episodes, req.samples)
        held_out.traj_refs = []
    finally:
        _shutdown(rollout, env_workers)
        if owns_ray:
            ray.shutdown()

    per_variant = {v: result.report() for v, result in held_out.variants.items()}
    return {
        "ckpt": req.ckpt, "model_path": model_path, "items": source, "num_items": len(items),
        "samples": req.samples, "temperature": req.temperature, "env": env.name, "agent": cfg.env.agent_fn,
        "reward": cfg.env.reward_fn_path, "max_new_tokens": cfg.rollout.max_new_tokens,
        "outcomes": list(env.outcomes),
        "variants": per_variant, "examples": examples,
        "time_s": {"total": time.perf_counter() - t0, "episodes": t_episodes},
    }


def _shutdown(rollout: Any, env_workers: list[Any]) -> None:
    import ray

    if rollout is not None:
        try:
            ray.get(rollout.shutdown.remote(), timeout=10)
        except Exception as err:  # shutting down anyway; say why it was not clean
            print(f"rlsys eval: rollout shutdown: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    for actor in [a for a in [rollout, *env_workers] if a is not None]:
        ray.kill(actor, no_restart=True)


# --- output ----------------------------------------------------------------------------------------
def format_table(report: dict[str, Any]) -> str:
    """The printed report: one column per variant, the environment's rates first (in its order), then reward and
    the error table (in the environment's outcome order, failures after)."""
    variants = list(report["variants"])
    width = max(10, *(len(v) + 2 for v in variants))
    first = report["variants"][variants[0]]
    rates = [k for k in dict.fromkeys(k for v in variants for k in report["variants"][v])
             if k not in REPORT_KEYS and not k.endswith("_episodes")]
    # items of each kind, where the environment counts them (the same items in every variant)
    kind_counts = ", ".join(f"{k.removesuffix('_episodes')} {int(x)}" for k, x in first.items()
                            if k.endswith("_episodes"))
    order = report.get("outcomes", [])
    labels = sorted({k for v in variants for k in report["variants"][v]["errors"]},
                    key=lambda k: (order.index(k) if k in order else len(order), k))
    temp = report["temperature"]
    lines = [
        f"rlsys eval: {report['model_path']} ({report.get('env', '?')} environment)",
        f"  {report['num_items']} items from {report['items']}"
        + (f"; by kind: {kind_counts}" if kind_counts else ""),
        f"  {report['samples']} sample(s) per item and variant, "
        + ("greedy" if temp == 0 else f"temperature {temp:g}")
        + f"; {sum(report['variants'][v]['episodes'] for v in variants)} episodes in "
        f"{report['time_s']['episodes']:.1f} s",
        "",
        f"  {'':<22}" + "".join(f"{v:>{width}}" for v in variants),
    ]
    for name in [*rates, "rewards_mean", "failed_frac"]:
        lines.append(f"  {name:<22}" + "".join(_cell(report["variants"][v].get(name), width) for v in variants))
    episode = list(dict.fromkeys(k for v in variants for k in report["variants"][v].get("episode", {})))
    if episode:
        lines.append("  per episode (mean)")
        for name in episode:
            lines.append(f"    {name:<20}" + "".join(_cell(report["variants"][v].get("episode", {}).get(name), width)
                                                for v in variants))
    lines.append("  error table (fraction of episodes)")
    for label in labels:
        lines.append(f"    {label:<20}" + "".join(_cell(report['variants'][v]['errors'].get(label, 0.0), width)
                                             for v in variants))
    return "\n".join(lines)


def _cell(x: Any, width: int) -> str:
    return f"{x:>{width}.3f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlsys eval", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default="rlsys:tiny",
                   help="model folder, run directory (its latest checkpoint) or rlsys:tiny (default)")
    p.add_argument("--items", "--boards", dest="items", metavar="FILE",
                   help="JSONL held-out items (default: the environment's held-out items)")
    p.add_argument("--perturb", action="store_true",
                   help="also run every perturbation of the environment, reported separately")
    p.add_argument("--n", type=int, metavar="N", help="evaluate the first N items only")
    p.add_argument("--samples", type=int, default=1, metavar="K", help="episodes per item and variant (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--config", metavar="FILE.toml", help="config to start from (default: the checkpoint's own)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. rollout.max_new_tokens=48")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"cluster.address={json.dumps(args.address)}")
    for flag, value in (("--samples", args.samples), ("--n", args.n)):
        if value is not None and value < 1:
            print(f"rlsys eval: {flag} {value}: must be at least 1", file=sys.stderr)
            return 2
    req = EvalRequest(ckpt=args.ckpt, items=args.items, perturb=args.perturb, n=args.n, samples=args.samples,
                      temperature=args.temperature, config=args.config, overrides=overrides)
    try:
        report = run_eval(req)
    except UserInputError as err:  # bad checkpoint, items, config or plug-in: one line, no traceback
        print(f"rlsys eval: {err}", file=sys.stderr)
        return 2
    print(format_table(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"  report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
