"""The training driver: `python -m jobs.train --config FILE` (what `ray job submit` runs) or `rlsys train`.

The loop reads like the algorithm: rollout, sleep, train, push weights, wake, log (with `rollout.overlap`, the
next step's rollout starts before the update and is waited for before the push: `RolloutAhead`). Everything
else lives in functions below it or in jobs/job.py. The driver passes ObjectRefs and never pulls
trajectories into its own process: it sees per-trajectory summaries (scalars) only.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rlsys.collapse import CollapseWatch
from rlsys.config import Config, add_config_args, config_from_args, dump_config
from rlsys.errors import exit_status
from rlsys.metrics import MetricsLogger, Timer, console_line, failure_lines, rollout_metrics
from rlsys.trackers import open_trackers


def run_training(cfg: Config, marks: dict[str, float] | None = None) -> Path:
    """Run the job described by ``cfg``; returns the run directory. ``marks``: the caller's start-up milestones
    (name -> time.time(), e.g. `rlsys train`'s `cli_started`, `config_loaded`), reported with the job's own."""
    from rlsys import prefetch

    prefetch.start_for(cfg)  # `cluster.prefetch`: reads the big libraries' files while the imports below begin
    marks = {**(marks or {}), "driver_entered": time.time()}  # the driver's own milestones, before Job.start's
    import ray

    from jobs.items import preflight
    from jobs.job import Job
    from jobs.session import RayGauges, import_meanwhile

    marks["driver_imported"] = time.time()
    checked = preflight(cfg)  # bad plug-ins and data are refused before the run directory or Ray exist
    marks["preflight_done"] = time.time()
    if cfg.logging.tensorboard:  # after the preflight: a refused job returns without an import still running
        import_meanwhile("torch.utils.tensorboard")  # the MetricsLogger's, ready when Job.start returns
    run_dir = prepare_run_dir(cfg)
    job = Job.start(cfg, checked, marks)
    startup = StartupClock(job)
    stop = StopRequest()  # after ray.init, which replaces the SIGTERM handler (docs/gpu.md, "What rlsys relies on")
    trackers = open_trackers(cfg, run_dir, job.start_step)  # logging.trackers: W&B, MLflow (rlsys/trackers.py)
    logger = MetricsLogger(run_dir, cfg.tb_dir() if cfg.logging.tensorboard else None, start_step=job.start_step,
                           sinks=[RayGauges(job.namespace), *trackers])
    timer = Timer()
    print(f"rlsys: run directory {run_dir.resolve()} (namespace {job.namespace})", flush=True)
    try:
        if cfg.eval.at_start and job.start_step == 0:
            evaluate(job, logger, 0, "start")
        last = job.start_step  # the step count when training stops: `max_steps`, or less in a time box
        ahead = RolloutAhead(job) if cfg.rollout.overlap else None  # the next step's rollout during this update
        collapse = CollapseWatch(0 if cfg.algo.name == "sft" else cfg.algo.collapse_steps, cfg.algo.stop_on_collapse,
                                 cfg.algo.collapse_share)
        for step in training_steps(job.start_step, cfg.max_steps, startup.t0, cfg.max_train_minutes):
            t0 = time.perf_counter()
            with timer("rollout"):  # batch_size boards; filtered and topped up under algo.dynamic_sampling
                traj_refs, summaries, groups = ahead.take(step) if ahead and ahead.has(step) else \
                    job.rollout_until_full(step)
            with timer("sleep"):
                engine_stats = job.engines.sleep(level=job.sleep_level)
            if ahead and step + 1 < cfg.max_steps and not time_is_up(startup.t0, cfg.max_train_minutes):
                ahead.start(step + 1)  # on the weights of before this update: one step off-policy
            with timer("train"):
                stats = job.train(traj_refs, summaries)
            if ahead:
                with timer("rollout_wait"):  # a push must not land while the engines generate
                    ahead.wait()
            with timer("sync"):
                sync = job.weights.push()
            with timer("wake"):
                job.engines.wake()
            with timer("canary"):
                canary = job.weights.check_canary()
            m = {**rollout_metrics(summaries, job.outcome_labels), **groups, **engine_stats, **stats, **sync, **canary,
                 **timer.pop(), **startup.once(), **(ahead.metrics() if ahead else {})}
            m["time/step"] = time.perf_counter() - t0
            sampling = m.get("time/rollout_sampling", m["time/rollout"])  # overlapped: its own time, not the wait
            m["perf/tokens_per_s"] = sum(s.response_len for s in summaries) / max(sampling, 1e-9)
            collapsed = collapse.update(m)
            logger.log(step, m)
            print(console_line(step, cfg.max_steps, m), flush=True)
            for line in failure_lines(summaries):
                print(line, flush=True)
            cursor = ahead.cursor() if ahead else None  # a rollout sampled ahead is not in a checkpoint
            if stop.requested:  # SIGTERM (`ray job stop`) or Ctrl-C: keep what was learned, then leave
                job.checkpoint(step + 1, final=True, data_state=cursor)
                print(f"rlsys: stopped by {stop.requested} after step {step + 1}; resume with --resume auto")
                return run_dir
            job.maybe_checkpoint(step + 1, data_state=cursor)
            last = step + 1
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.max_steps:
                evaluate(job, logger, step + 1, f"step{step + 1}")
            if collapsed:
                print(f"rlsys: algo.stop_on_collapse: training stops after step {step + 1}", flush=True)
                break
        if cfg.eval.at_end:
            evaluate(job, logger, last, "end")
        job.checkpoint(last, final=True, data_state=ahead.cursor() if ahead else None)
    finally:
        if ahead:
            ahead.close()
        stop.restore()
        logger.close()
        job.shutdown()
        if ray.is_initialized() and job.owns_ray:
            ray.shutdown()
    return run_dir


def time_is_up(started_at: float, max_minutes: float | None) -> bool:
    """Whether `max_train_minutes` have passed since ``started_at`` (time.time())."""
    return max_minutes is not None and time.time() - started_at >= max_minutes * 60


class RolloutAhead:
    """`rollout.overlap`: the next step's rollout phase runs in a thread of the driver while the learner trains on
    this step's batch, so a step takes about the longer of the two instead of their sum. It samples with the
    weights of before this step's update: its batch is one update old when the learner trains on it, which the
    losses' importance weights against the sampling logprobs account for (`algo.logp_mode`). It is waited for
    before each push (the engines must not generate while their weights change) and before evals and checkpoints;
    its boards are past the data cursor by then, so checkpoints take the cursor of before it (`cursor`): a resumed
    job samples that step's boards again."""

    def __init__(self, job) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.job = job
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsys-rollout-ahead")
        self._step: int | None = None
        self._future = None
        self._cursor: dict | None = None  # the data cursor before the rollout in flight or not yet taken
        self._taken_s: float | None = None  # seconds the rollout of the step being trained ran (beside an update)

    def start(self, step: int) -> None:
        self._cursor = self.job.data.state_dict()
        self._step = step
        self._future = self._pool.submit(self._timed, step)

    def _timed(self, step: int):
        t = time.perf_counter()
        return self.job.rollout_until_full(step), time.perf_counter() - t

    def has(self, step: int) -> bool:
        return self._future is not None and self._step == step

    def wait(self) -> None:
        """Until the rollout in flight is done; its error, if any, raised here."""
        if self._future is not None and (error := self._future.exception()) is not None:  # waits for it
            raise error

    def take(self, step: int):
        """The rollout sampled ahead for ``step``: (trajectory refs, summaries, group counts)."""
        future, self._future, self._step, self._cursor = self._future, None, None, None
        out, self._taken_s = future.result()
        return out

    def cursor(self) -> dict | None:
        """The data cursor a checkpoint must hold: from before a rollout sampled ahead and not trained on yet."""
        return self._cursor

    def metrics(self) -> dict[str, float]:
        """This step's: whether its batch was sampled ahead, and then how long its rollout ran."""
        sampled, self._taken_s = self._taken_s, None
        if sampled is None:
            return {"rollout/off_policy_steps": 0.0}
        return {"rollout/off_policy_steps": 1.0, "time/rollout_sampling": sampled}

    def close(self) -> None:
        """Without waiting: a rollout still in flight (the update failed meanwhile) ends when the job's actors go."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def training_steps(start: int, max_steps: int, started_at: float, max_minutes: float | None):
    """Step indices from ``start`` to ``max_steps``; with ``max_minutes`` (`max_train_minutes`), none starts once
    that many minutes have passed since ``started_at`` (time.time()), and the stop is said in one line."""
    for step in range(start, max_steps):
        if time_is_up(started_at, max_minutes):
            print(f"rlsys: max_train_minutes={max_minutes:g} reached before step {step}: training stops",
                  flush=True)
            return
        yield step


_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """When this process started (time.time() scale; Linux /proc, ~1 s resolution), else when this module was
    imported: `rlsys train` and `python -m jobs.train` import it within a second of starting."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        started = btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT
    return started if started <= _IMPORTED_AT + 1 else _IMPORTED_AT  # a clock oddity: trust the import time


class StartupClock:
    """Start-up as a user sees it: seconds from this process's start to the job being ready (engines up,
    learner loaded, canary passed), to the engine being ready and to the first sampled token (the first
    generate that returned). Printed once after Job.start and once after the first step, and recorded in
    that step's metrics as `startup/*`."""

    def __init__(self, job) -> None:
        self.job = job
        self.t0 = process_start_time()
        self.ready_s = time.time() - self.t0
        self.pending = True
        print(f"rlsys: startup: job ready {self.ready_s:.1f} s after the process started", flush=True)

    def once(self) -> dict[str, float]:
        """The `startup/*` metrics the first time, {} afterwards."""
        if not self.pending:
            return {}
        self.pending = False
        import ray

        times = ray.get([r.startup_times.remote() for r in self.job.rollouts])
        firsts = [t["first_sample_at"] for t in times if t.get("first_sample_at")]
        m = {"startup/job_ready_s": self.ready_s,
             "startup/engine_build_s": max(t["engine_build_s"] for t in times),
             "startup/engine_ready_s": max(t["engine_ready_at"] for t in times) - self.t0}
        began = [t["start_called_at"] for t in times if t.get("start_called_at")]
        if began:
            m["startup/engine_start_called_s"] = min(began) - self.t0
        # the driver's milestones (Job.start): Ray up, the actors' processes up, engines ready, learner answered
        m.update({f"startup/{k}_s": v - self.t0 for k, v in self.job.startup_marks.items()})
        from rlsys import prefetch

        if prefetch.last_run is not None and prefetch.last_run.done_at is not None:
            m["startup/prefetch_started_s"] = prefetch.last_run.started_at - self.t0
            m["startup/prefetch_done_s"] = prefetch.last_run.done_at - self.t0
            m["startup/prefetch_gib"] = prefetch.last_run.bytes / 2**30
        if firsts:
            m["startup/first_sample_s"] = min(firsts) - self.t0
        first = f"{m['startup/first_sample_s']:.1f} s" if firsts else "-"
        print(f"rlsys: startup: engine built in {m['startup/engine_build_s']:.1f} s, ready "
              f"{m['startup/engine_ready_s']:.1f} s and first sampled token {first} after the process started",
              flush=True)
        steps = [(label, m.get(f"startup/{key}_s")) for key, label in STARTUP_MILESTONES]
        steps.append(("libraries prefetched", m.get("startup/prefetch_done_s")))  # in parallel with the rest
        print("rlsys: startup: " + ", ".join(f"{label} {v:.1f}" for label, v in steps if v is not None)
              + " (s after the process started)", flush=True)
        return m


# the `startup/*` milestones in the order a job reaches them, as printed
STARTUP_MILESTONES = [("cli_started", "CLI started"), ("config_loaded", "config loaded"),
                      ("driver_entered", "driver entered"), ("driver_imported", "driver imported"),
                      ("preflight_done", "preflight done"), ("job_start", "job start"), ("ray_ready", "Ray up"),
                      ("actors_up", "actors up"),
                      ("engine_start_called", "engine start called"), ("engine_ready", "engine ready"),
                      ("engines_ready", "engines seen by the driver"), ("learner_ready", "learner answered"),
                      ("canary_passed", "canary passed"), ("first_sample", "first sampled token")]


class StopRequest:
    """SIGTERM/SIGINT set a flag the loop checks between steps, so a stop checkpoints a consistent state
    instead of dying mid-update; a second signal stops at once. (`ray job stop` sends SIGKILL ~3 s after
    SIGTERM: raise RAY_JOB_STOP_WAIT_TIME_S on the cluster when steps are longer than that.)"""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
        self.requested = signal.Signals(signum).name
        print(f"rlsys: {self.requested} received: finishing this step, then checkpointing", flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def evaluate(job, logger: MetricsLogger, step: int, tag: str) -> dict[str, float]:
    """Held-out evaluation (a config-selected phase: eval.at_start / every / at_end); a few episodes of each outcome
    go to <run_dir>/evals/<tag>-examples.json."""
    t0 = time.perf_counter()
    metrics = job.evaluate(tag, Path(job.cfg.run_dir) / "evals" / f"{tag}-examples.json")
    metrics["time/eval"] = time.perf_counter() - t0
    logger.log_eval(step, tag, metrics)
    print(f"eval[{tag}] after {step} steps ({metrics['time/eval']:.1f} s): {eval_line(metrics)}", flush=True)
    return metrics


def eval_line(metrics: dict[str, float]) -> str:
    """The reward and the outcome rates of the default prompt, then each perturbation's, compactly."""
    def rates(prefix: str) -> str:
        keys = [k for k in metrics if k.startswith(prefix) and "/" not in k[len(prefix):]
                and ((k.endswith("_rate") and not k.endswith("segment_break_rate")) or k.endswith("rewards_mean"))]
        return " ".join(f"{k[len(prefix):].removesuffix('_rate').removesuffix('_move')} {metrics[k]:.3f}" for k in keys)

    variants = sorted({k.split("/")[1] for k in metrics if k.startswith("eval/") and k.count("/") == 2})
    return "  |  ".join([rates("eval/")] + [f"{v}: {rates(f'eval/{v}/')}" for v in variants if rates(f"eval/{v}/")])


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.resolved.toml")
    return run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__.splitlines()[0])
    add_config_args(parser)
    args = parser.parse_args(argv)
    return exit_status(lambda: run_training(config_from_args(args)))


if __name__ == "__main__":
    sys.exit(main())
