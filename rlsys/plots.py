"""`rlsys report`'s plots: one run's PNGs (`write_plots`, RUN_DIR/plots/) and several runs' curves in one PNG
(`write_comparison_plot`, `rlsys report RUN RUN ... --plot FILE`). matplotlib is imported when a plot is drawn."""
from __future__ import annotations

from pathlib import Path

from rlsys.envs.base import label_order
from rlsys.report import PHASES, Run, as_float, entropy_top_frac, moving_mean, outcome_order

# error-table colours: failures grey/red/orange, legal moves blue to green (unknown labels: matplotlib's cycle)
ERROR_COLORS = {"no_tool_call": "#8c8c8c", "parse_error": "#d62728", "occupied": "#ff7f0e", "out_of_range": "#bcbd22",
                "legal_suboptimal": "#1f77b4", "optimal": "#2ca02c", "win": "#17becf"}


COMPARED = (("rollout/rewards_mean", "rollout reward"), ("rollout/zero_var_group_frac", "zero-variance groups"),
            ("train/entropy", "token entropy"))


LINE_STYLES = ("-", "--", ":", "-.")


def line_styles(names: list[str]) -> list[tuple[str, str]]:
    """(colour, line style) of each run's line: runs whose names share the part before their last digits (lora0,
    lora1: seeds of one variant) share a colour and differ in style; runs of one variant only (gsm0, gsm1, gsm2)
    get a colour each."""
    import re

    variant = [re.sub(r"[-_]?(seed)?\d+$", "", n) or n for n in names]  # lora0 -> lora
    if len(set(variant)) == 1:
        return [(f"C{i}", "-") for i in range(len(names))]
    colour = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(variant))}
    seen: dict[str, int] = {}
    out = []
    for v in variant:
        seen[v] = seen.get(v, -1) + 1
        out.append((colour[v], LINE_STYLES[seen[v] % len(LINE_STYLES)]))
    return out


def write_comparison_plot(runs: list[Run], path: str | Path, smooth: int = 10) -> Path:
    """One PNG of several runs: reward, zero-variance group fraction (before dynamic sampling's filter) and token
    entropy against the step, each a ``smooth``-step moving average, one line per run (`line_styles`). A run with
    `algo.top_entropy_frac` is marked * (its entropy is the selected tokens' mean, not comparable with the others)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(COMPARED), 1, figsize=(7, 2.4 * len(COMPARED)), sharex=True)
    marked = [entropy_top_frac(run) is not None for run in runs]
    for run, star, (colour, style) in zip(runs, marked, line_styles([r.path.name for r in runs])):
        for ax, (key, _) in zip(axes, COMPARED):
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, moving_mean(values, smooth), color=colour, ls=style, lw=1.2,
                        label=run.path.name + ("*" if star else ""))
    for ax, (key, what) in zip(axes, COMPARED):
        if key == "train/entropy" and any(marked):
            what += "\n(*: top-entropy tokens')"
        ax.set(ylabel=what)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{smooth}-step moving averages")
    axes[0].legend(fontsize=8, ncol=3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(run: Run, out_dir: str | Path | None = None) -> tuple[list[Path], list[str]]:
    """PNG plots into ``out_dir`` (default RUN_DIR/plots); returns (written files, skipped plots with why)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = Path(out_dir) if out_dir else run.path / "plots"
    out.mkdir(parents=True, exist_ok=True)
    title = run.path.resolve().name
    written, skipped = [], []

    from matplotlib.ticker import MaxNLocator

    def save(fig, name: str) -> None:
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    # reward: mean, +-std band, min/max band, held-out eval points
    steps, mean = run.series("rollout/rewards_mean")
    if run.config.get("algo", {}).get("name") == "sft":
        skipped.append("reward.png: SFT has no reward")
    elif steps:
        fig, ax = plt.subplots(figsize=(7, 4))
        lo_s, lo = run.series("rollout/rewards_min")
        hi_s, hi = run.series("rollout/rewards_max")
        sd_s, sd = run.series("rollout/rewards_std")
        if sd_s == steps:
            low, high = [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)]
            if lo_s == steps and hi_s == steps:  # the band never leaves the rewards actually seen
                low, high = [max(a, b) for a, b in zip(low, lo)], [min(a, b) for a, b in zip(high, hi)]
            ax.fill_between(steps, low, high, color="tab:blue", alpha=0.15, label="rollout mean ± std")
        ax.plot(steps, mean, color="tab:blue", lw=0.8, alpha=0.6 if len(steps) >= 20 else 1.0,
                marker="o" if len(steps) < 30 else None, ms=3, label="rollout mean")
        if len(steps) >= 20:  # a batch is a few dozen episodes: the trend needs smoothing to be seen
            k = max(5, len(steps) // 10)
            ax.plot(steps, moving_mean(mean, k), color="navy", lw=2, label=f"rollout mean, {k}-step average")
        ev = [(e["step"], as_float(e.get("eval/rewards_mean"))) for e in run.evals]
        ev = [(s, v) for s, v in ev if v is not None]
        if ev:
            greedy = not run.config.get("eval", {}).get("temperature", 0.0)
            ax.plot([s for s, _ in ev], [v for _, v in ev], "s", color="tab:red",
                    label="held-out eval" + (" (greedy)" if greedy else ""))
        ax.set(xlabel="step", ylabel="reward", title=f"reward: {title}")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        save(fig, "reward.png")
    else:
        skipped.append("reward.png: no rollout/rewards_mean")

    def plot_series(key: str, name: str, color: str, ylabel: str, what: str) -> None:
        """One metric against the step, as ``name``; skipped (and said) when the run has none of it."""
        steps, values = run.series(key)
        if not steps:
            skipped.append(f"{name}: no {key}")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, values, color=color)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{what}: {title}")
        ax.grid(alpha=0.3)
        save(fig, name)

    plot_series("rollout/response_len_mean", "response_len.png", "tab:green", "tokens",
                "response length (mean sampled tokens)")
    plot_series("train/loss", "loss.png", "tab:purple", "loss", "train/loss")

    series = {k: run.series(k) for k in ("train/logp_diff_mean", "train/logp_diff_max", "sync/canary_logp_diff")}
    series = {k: v for k, v in series.items() if v[0]}
    if series:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, (s, v) in series.items():
            ax.plot(s, [max(x, 1e-12) for x in v], label=key)
        ax.set_yscale("log")
        ax.set(xlabel="step", ylabel="|logp engine - logp learner|", title=f"stale-weights alarm: {title}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        save(fig, "logp_diff.png")
    else:
        skipped.append("logp_diff.png: no train/logp_diff_mean (SFT runs log none)")

    series = {k: run.series(k) for k in ("train/entropy", "train/kl_ref")}
    series = {k: v for k, v in series.items() if v[0]}
    if series:
        fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.5 + 1.5 * len(series)), sharex=True, squeeze=False)
        for ax, (key, (s, v)) in zip(axes[:, 0], series.items()):
            ax.plot(s, v, color="tab:orange" if key == "train/entropy" else "tab:brown")
            frac = entropy_top_frac(run) if key == "train/entropy" else None
            what = f"{key} (the top {frac:g} of the sampled tokens)" if frac else key
            ax.set(ylabel="nats", title=f"{what}: {title}")
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        save(fig, "entropy.png")
    else:
        skipped.append("entropy.png: no train/entropy (a run from before it was logged)")

    phases = [(p, run.series(f"time/{p}")) for p in PHASES]
    phases = [(p, sv) for p, sv in phases if sv[0]]
    total_steps, total = run.series("time/step")
    if phases or total_steps:
        fig, ax = plt.subplots(figsize=(7, 4))
        if phases and all(sv[0] == phases[0][1][0] for _, sv in phases):
            ax.stackplot(phases[0][1][0], *[sv[1] for _, sv in phases], labels=[p for p, _ in phases], alpha=0.8)
        if total_steps:
            ax.plot(total_steps, total, color="black", lw=1, label="step (all)")
        ax.set(xlabel="step", ylabel="seconds", title=f"time per step: {title}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", ncol=4)
        save(fig, "step_time.png")
    else:
        skipped.append("step_time.png: no time/* metrics")

    errors = run.keys("error/") if run.config.get("algo", {}).get("name") != "sft" else []
    order = outcome_order(run.config)
    errors.sort(key=lambda k: label_order(k.removeprefix("error/"), order))
    if errors:
        fig, ax = plt.subplots(figsize=(7, 4))
        x = [int(r["step"]) + 1 for r in run.rows]
        ys = [[as_float(r.get(k)) or 0.0 for r in run.rows] for k in errors]
        keep = [(k, y) for k, y in zip(errors, ys) if any(y)]
        if keep:
            labels = [k.removeprefix("error/") for k, _ in keep]
            colors = [ERROR_COLORS.get(lab, f"C{i}") for i, lab in enumerate(labels)]
            ax.stackplot(x, *[y for _, y in keep], labels=labels, colors=colors, alpha=0.85)
        ax.set(xlabel="step", ylabel="fraction of trajectories", ylim=(0, 1), title=f"error table: {title}")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        save(fig, "errors.png")
    return written, skipped
