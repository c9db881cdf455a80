"""Multi-stage recipes: `python -m jobs.recipe --config configs/recipes/tictactoe-tiny.toml` or `rlsys recipe`.

A recipe runs job configs one after the other (SFT warm start, then GSPO, say) in one embedded Ray
session, each stage starting from the previous stage's final checkpoint, and ends with a summary of the
last stage: a table on the console (`summary.md`, `summary.json`) and a plot of reward and legal-move
rate per step (`curves.png`), all in the recipe's run directory.

Recipe file (TOML):

    run_dir = "runs/tictactoe-tiny"        # optional; unset = runs/recipe-<file name>-<time>
    seed = 0                               # optional; sets `seed` of every stage
    report = "gspo"                        # optional; the stage the summary describes (default: the last)

    [[stages]]
    name = "sft"                           # the stage's folder under run_dir; also its CLI override prefix
    config = "../tictactoe-tiny-sft.toml"  # optional: a job config file, relative to this recipe file
    overrides = ["max_steps=150"]          # optional: dotted overrides, as on the `rlsys train` command line
    [stages.set]                           # optional: a config tree merged over `config`
    learner = { lr = 3e-3 }

    [[stages]]
    name = "gspo"
    config = "../tictactoe-tiny-gspo.toml"
    # from_previous = true (default for every stage but the first): model.ckpt is set to the previous
    # stage's final checkpoint folder, <run_dir>/<previous name>/checkpoints/step_NNNNNN

Per stage, later wins: the config file < `set` < `overrides` < what the recipe sets (run_dir =
<run_dir>/<name>, cluster.namespace, model.ckpt when chained, the recipe's seed) < command-line overrides
(`rlsys recipe --config R.toml gspo:max_steps=50 seed=3`: `STAGE:KEY=VALUE` for one stage, `KEY=VALUE`
for every stage). Every stage config is resolved and validated before anything starts.

The summary reads the report stage's `metrics.jsonl` (first and last `--window` steps: mean reward and the
error-table fractions) and `eval.jsonl`: held-out rates "before" (the stage's `start` evaluation, or the
previous stage's last one) and "after" (its `end` evaluation); beside the reward, the environment's headline rate
(`Environment.headline`: the share of episodes with one of its outcomes, e.g. any legal move). Timings include
Ray's start.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlsys.config import Config, ConfigError, leaf_items, load_config
from rlsys.report import is_eval_rate, moving_mean, run_environment


@dataclass
class Stage:
    name: str
    config: Path | None = None
    overrides: list[str] = field(default_factory=list)
    from_previous: bool = True


@dataclass
class Recipe:
    path: Path
    stages: list[Stage]
    run_dir: str = ""
    seed: int | None = None
    report: str = ""


# --- reading and resolving ------------------------------------------------------------------------
def read_recipe(path: str | Path) -> Recipe:
    """Parse a recipe file; ConfigError names the stage and key that is wrong."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe {p}: not found")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"recipe {p}: invalid TOML: {err}") from None
    unknown = set(data) - {"run_dir", "seed", "report", "stages"}
    if unknown:
        raise ConfigError(f"recipe {p}: unknown key(s) {sorted(unknown)}; known: run_dir, seed, report, stages")
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise ConfigError(f"recipe {p}: needs at least one [[stages]] table")
    stages = []
    for i, raw in enumerate(raw_stages):
        where = f"recipe {p}: stages[{i}]"
        unknown = set(raw) - {"name", "config", "set", "overrides", "from_previous"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: name, config, set, overrides, "
                              "from_previous")
        name = raw.get("name", f"stage{i}")
        if not isinstance(name, str) or not name or "/" in name or ":" in name:
            raise ConfigError(f"{where}: name must be a non-empty folder name without '/' or ':', got {name!r}")
        config = None
        if "config" in raw:
            config = (p.parent / raw["config"]).resolve()
            if not config.is_file():
                raise ConfigError(f"{where} ({name}): config file {config} not found")
        overrides = list(raw.get("overrides", []))
        if not all(isinstance(o, str) for o in overrides):
            raise ConfigError(f"{where} ({name}): overrides must be a list of 'key=value' strings")
        stages.append(Stage(name=name, config=config, overrides=_flatten(raw.get("set", {})) + overrides,
                            from_previous=bool(raw.get("from_previous", i > 0))))
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ConfigError(f"recipe {p}: stage names must be unique, got {names}")
    report = data.get("report", names[-1])
    if report not in names:
        raise ConfigError(f"recipe {p}: report = {report!r} names no stage; stages: {names}")
    return Recipe(path=p, stages=stages, run_dir=str(data.get("run_dir", "")), seed=data.get("seed"), report=report)


def _flatten(tree: dict[str, Any]) -> list[str]:
    """{"learner": {"lr": 3e-3}} -> ["learner.lr=0.003"] (values written as TOML, parsed back by load_config)."""
    import tomli_w

    return [f"{key}={tomli_w.dumps({'v': value}).partition('=')[2].strip()}" for key, value in leaf_items(tree)]


def resolve_stages(recipe: Recipe, run_dir: Path, namespace: str, cli_overrides: list[str]) -> list[Config]:
    """Every stage's validated Config. A chained stage's model.ckpt is the previous stage's final checkpoint
    folder (it does not exist yet; it is checked again when the stage starts)."""
    names = {s.name for s in recipe.stages}
    for item in cli_overrides:
        stage, sep, _ = item.partition(":")
        if sep and "=" not in stage and stage not in names:
            raise ConfigError(f"override {item!r}: no stage named {stage!r}; stages: {sorted(names)}")
    cfgs: list[Config] = []
    for stage in recipe.stages:
        mine = [o.partition(":")[2] if _stage_prefix(o) == stage.name else o for o in cli_overrides
                if _stage_prefix(o) in (None, stage.name)]
        forced = [f"run_dir={json.dumps(str(run_dir / stage.name))}", f"cluster.namespace={json.dumps(namespace)}"]
        if recipe.seed is not None:
            forced.append(f"seed={int(recipe.seed)}")
        if stage.from_previous and cfgs:
            forced.append(f"model.ckpt={json.dumps(str(final_checkpoint(cfgs[-1])))}")
        try:
            cfgs.append(load_config(stage.config, overrides=[*stage.overrides, *forced, *mine]))
        except ConfigError as err:
            raise ConfigError(f"recipe stage {stage.name!r}: {err}") from None
    return cfgs


def _stage_prefix(override: str) -> str | None:
    head, sep, _ = override.partition(":")
    return head if sep and "=" not in head else None


def final_checkpoint(cfg: Config) -> Path:
    """The checkpoint a finished run leaves: <checkpoint_dir>/step_<max_steps> (what `latest` names)."""
    return cfg.checkpoint_dir() / f"step_{cfg.max_steps:06d}"


# --- running ----------------------------------------------------------------------------------------
def run_recipe(recipe: Recipe, run_dir: str | Path | None = None, cli_overrides: list[str] | None = None,
               window: int = 20) -> dict[str, Any]:
    """Run every stage in one Ray session (embedded unless an address is set); returns the summary."""
    import ray

    from jobs.session import init_ray
    from jobs.train import run_training

    t0 = time.perf_counter()
    root = Path(run_dir or recipe.run_dir or Path("runs") / f"recipe-{recipe.path.stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    namespace = "rlsys-recipe-" + "".join(c if c.isalnum() or c in "_.-" else "-" for c in root.resolve().name)
    cfgs = resolve_stages(recipe, root, namespace, list(cli_overrides or []))
    root.mkdir(parents=True, exist_ok=True)
    owns_ray = init_ray(cfgs[0].cluster, namespace)
    timings: dict[str, float] = {"ray_start": time.perf_counter() - t0}
    try:
        for stage, cfg in zip(recipe.stages, cfgs):
            if stage.from_previous and cfg is not cfgs[0] and not Path(cfg.model.ckpt).is_dir():
                raise RuntimeError(f"recipe stage {stage.name!r}: the previous stage left no checkpoint at "
                                   f"{cfg.model.ckpt}")
            print(f"rlsys recipe: stage {stage.name} -> {cfg.run_dir} (from {cfg.model.ckpt})", flush=True)
            started = time.perf_counter()
            run_training(cfg)
            timings[stage.name] = time.perf_counter() - started
            _wait_for_actor_names()  # the next stage reuses the names learner-0, rollout-0, env-<i>
    finally:
        if owns_ray and ray.is_initialized():
            ray.shutdown()
    timings["total"] = time.perf_counter() - t0
    index = [s.name for s in recipe.stages].index(recipe.report)
    summary = summarize(Path(cfgs[index].run_dir), Path(cfgs[index - 1].run_dir) if index else None, window)
    summary["time_s"] = timings
    summary["run_dir"] = str(root.resolve())
    summary["stages"] = {s.name: c.run_dir for s, c in zip(recipe.stages, cfgs)}
    write_summary(root, summary)
    plot_curves(Path(cfgs[index].run_dir), root / "curves.png", summary)
    return summary


def _wait_for_actor_names(timeout_s: float = 60.0) -> None:
    """Until no named actor is left in the driver's namespace (where the stages' actors live, whoever
    started Ray)."""
    import ray

    namespace = ray.get_runtime_context().namespace
    deadline = time.monotonic() + timeout_s
    while any(a["namespace"] == namespace for a in ray.util.list_named_actors(all_namespaces=True)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"recipe: the previous stage's actors in {namespace!r} are still alive after "
                               f"{timeout_s:g} s")
        time.sleep(0.2)


# --- summary ------------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def headline_fraction(row: dict[str, Any], outcomes: tuple[str, ...]) -> float:
    """The share of a step's episodes whose outcome is one of ``outcomes`` (the sum of their error-table rates)."""
    return sum(float(row.get(f"error/{o}", 0.0)) for o in outcomes)


def headline_of(env: Any) -> dict[str, Any] | None:
    """An environment's headline rate (`Environment.headline`) as {"name", "outcomes", "heldout_rate"}; None when it
    has none or could not be loaded here (``env`` None)."""
    return env.headline._asdict() if env is not None and env.headline is not None else None


def summarize(stage_dir: Path, previous_dir: Path | None, window: int = 20) -> dict[str, Any]:
    """First/last `window` steps of the stage's metrics and its held-out rates before and after."""
    rows = [r for r in read_jsonl(stage_dir / "metrics.jsonl") if isinstance(r.get("rollout/rewards_mean"), float)]
    config = _read_toml(stage_dir / "config.resolved.toml")
    env = run_environment(config)
    order = env.outcomes if env is not None else ()
    headline = headline_of(env)
    keys = sorted({k for r in rows for k in r if k.startswith("error/")}, key=lambda k: _error_order(k, order))

    def mean(part: list[dict[str, Any]], key: str) -> float:
        vals = [float(r.get(key, 0.0)) for r in part]
        return sum(vals) / len(vals) if vals else math.nan

    first, last = rows[:window], rows[-window:]
    curve = {"rewards_mean": (mean(first, "rollout/rewards_mean"), mean(last, "rollout/rewards_mean"))}
    for k in keys:
        curve[k] = (mean(first, k), mean(last, k))
    if headline is not None:
        labels = tuple(headline["outcomes"])
        curve[headline["name"]] = tuple(sum(headline_fraction(r, labels) for r in part) / max(len(part), 1)
                                        for part in (first, last))
    evals = read_jsonl(stage_dir / "eval.jsonl")
    before = next((e for e in evals if e.get("tag") == "start"), None)
    if before is None and previous_dir is not None:
        before = (read_jsonl(previous_dir / "eval.jsonl") or [None])[-1]
    after = next((e for e in reversed(evals) if e.get("tag") == "end"), None)
    rates = dict.fromkeys(k.removeprefix("eval/") for row in (after, before) if row for k in row
                          if is_eval_rate(k) and k != "eval/rewards_mean")  # the environment's, in its order
    held_out = {name: (_rate(before, name), _rate(after, name)) for name in rates}
    eval_cfg = config.get("eval", {})
    return {"steps": len(rows), "window": min(window, len(rows)), "curve": curve, "held_out": held_out,
            "headline": headline,
            "held_out_episodes": (after or before or {}).get("eval/num_trajectories"),
            "held_out_temperature": float(eval_cfg.get("temperature", 0.0))}


def _read_toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def _error_order(key: str, outcomes: tuple[str, ...]) -> tuple[int, str]:
    """The error table in the environment's outcome order (worst first); other labels after, by name."""
    label = key.removeprefix("error/")
    return (outcomes.index(label), "") if label in outcomes else (len(outcomes), label)


def _rate(row: dict[str, Any] | None, name: str) -> float:
    return float(row.get(f"eval/{name}", math.nan)) if row else math.nan


def format_summary(s: dict[str, Any]) -> str:
    w = s["window"]
    lines = [f"RL curve ({s['steps']} steps)          first {w:>3}   last {w:>3}   change"]
    for key, (a, b) in s["curve"].items():
        lines.append(f"  {key:<30} {a:>9.3f} {b:>9.3f} {b - a:>+8.3f}")
    n, temp = s.get("held_out_episodes"), s.get("held_out_temperature", 0.0)
    how = "greedy" if not temp else f"T={temp:g}"
    lines.append(f"{f'held-out ({int(n) if n else chr(63)} episodes, {how})':<32} before RL  after RL   change")
    for key, (a, b) in s["held_out"].items():
        lines.append(f"  {key:<30} {a:>9.3f} {b:>9.3f} {b - a:>+8.3f}")
    t = s.get("time_s", {})
    if t:
        lines.append("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()))
    return "\n".join(lines)


def write_summary(root: Path, summary: dict[str, Any]) -> None:
    text = format_summary(summary)
    print(text, flush=True)
    (root / "summary.md").write_text("```\n" + text + "\n```\n")
    (root / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")


def plot_curves(stage_dir: Path, out: Path, summary: dict[str, Any] | None = None, smooth: int = 10) -> Path:
    """Reward and the environment's headline rate per step (thin: per step; thick: moving mean over `smooth`
    steps); the held-out headline rate before/after as dashed lines. Without a headline: the reward alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_jsonl(stage_dir / "metrics.jsonl") if isinstance(r.get("rollout/rewards_mean"), float)]
    steps = [r["step"] + 1 for r in rows]
    headline = (summary.get("headline") if summary is not None
                else headline_of(run_environment(_read_toml(stage_dir / "config.resolved.toml"))))
    panels = [("reward (batch mean)", [r["rollout/rewards_mean"] for r in rows])]
    if headline is not None:
        labels = tuple(headline["outcomes"])
        panels.append((f"{headline['name'].replace('_', ' ')} rate (sampled batch)",
                       [headline_fraction(r, labels) for r in rows]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    for ax, (title, ys) in zip(axes, panels):
        ax.plot(steps, ys, lw=0.6, alpha=0.4, color="tab:blue")
        ax.plot(steps, moving_mean(ys, smooth), lw=2, color="tab:blue", label=f"mean of {smooth} steps")
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(-1.05, 1.05)
    if headline is not None:
        rate = headline.get("heldout_rate")
        if summary is not None and rate in summary["held_out"]:
            before, after = summary["held_out"][rate]
            for value, style, label in ((before, ":", "held-out before"), (after, "--", "held-out after")):
                if not math.isnan(value):
                    axes[1].axhline(value, ls=style, color="tab:red", label=f"{label} {value:.2f}")
        axes[1].set_ylim(0, 1.05)
        axes[1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --- command line ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from rlsys.errors import exit_status

    parser = argparse.ArgumentParser(prog="python -m jobs.recipe", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, metavar="RECIPE.toml", help="the recipe file")
    parser.add_argument("--run-dir", help="the recipe's run directory (stages go to <run-dir>/<stage name>)")
    parser.add_argument("--seed", type=int, help="seed of every stage (overrides the recipe's)")
    parser.add_argument("--window", type=int, default=20, help="steps averaged at each end of the RL curve")
    parser.add_argument("overrides", nargs="*", metavar="[STAGE:]KEY=VALUE",
                        help="dotted overrides for one stage (gspo:max_steps=50) or every stage (seed=3)")
    args = parser.parse_args(argv)

    def run() -> None:
        recipe = read_recipe(args.config)
        if args.seed is not None:
            recipe.seed = args.seed
        run_recipe(recipe, args.run_dir, args.overrides, window=args.window)

    return exit_status(run, "rlsys recipe")


if __name__ == "__main__":
    sys.exit(main())
