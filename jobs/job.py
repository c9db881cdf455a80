"""The training job on Ray: `Job.start` places the actors, and its methods are the phases the driver loop calls
(jobs/train.py): rollout, train, evaluate, checkpoint. The weight push and the engines' sleep are its `weights`
(jobs/weight_sync.py) and `engines` (jobs/engine_group.py).

Placement (jobs/placement.py): with GPUs, one placement group with a `{"GPU": 1, "CPU": k}` bundle per GPU and the
rollout actor and learner sharing it with fractional `num_gpus`; without GPUs the same actors with `num_gpus=0`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from jobs.engine_group import EngineGroup, choose_sleep_level
from jobs.episodes import DEFAULT_VARIANT, agent_calls, run_episodes, sft_calls
from jobs.eval import collect_examples, eval_variants, evaluate_held_out
from jobs.items import preflight
from jobs.session import import_meanwhile, init_ray, job_namespace, wait_for_stale_actors
from jobs.weight_sync import WeightSync, canary_sequence, route_weights
from rlsys import checkpoint as ckpt
from rlsys.config import Config, dump_config
from rlsys.data import ItemStream
from rlsys.envs.base import Environment
from rlsys.models.resolve import resolve_model
from rlsys.sampling import GroupSieve, next_signal_rate
from rlsys.types import TrajectorySummary


@dataclass
class Job:
    cfg: Config
    namespace: str
    owns_ray: bool
    learners: list[Any]  # ranks of one process group; rank 0 reports metrics and writes checkpoints
    rollouts: list[Any]
    proxies: list[dict[str, Any]]
    env_workers: list[Any]
    engines: EngineGroup
    weights: WeightSync
    data: ItemStream
    model_path: str
    eval_items: list[dict[str, Any]]
    outcome_labels: tuple[str, ...] = ()
    env: Environment | None = None  # the driver's copy: outcomes, summary and perturbations for evaluations
    start_step: int = 0
    placement_group: Any = None
    startup_marks: dict[str, float] = field(default_factory=dict)  # milestone -> time.time() (Job.start)
    sleep_level: int = 1  # the engines' sleep between rollout and training (`choose_sleep_level`)
    reference: Any = None  # `learner.reference_actor`: annotates each rollout batch with the KL reference's logprobs

    @classmethod
    def start(cls, cfg: Config, checked: tuple[list, list] | None = None,
              marks: dict[str, float] | None = None) -> "Job":
        """Start (or join) Ray and the actors. ``checked`` = what `preflight(cfg)` returned, if it ran; ``marks``:
        the caller's start-up milestones so far (name -> time.time()), kept with Job.start's own."""
        items, eval_items = checked or preflight(cfg)  # bad plug-ins and data: refused before any actor
        resume_from = ckpt.find_resume(cfg.checkpoint.resume, cfg.checkpoint_dir())
        trainer_state = ckpt.read_trainer_state(resume_from) if resume_from else None
        # a resumed job starts learner and engine from the checkpoint's weights; with LoRA from the base, and the
        # learner loads the checkpoint's adapter (`Learner.load_state`), which the first push brings to the engines
        lora = cfg.learner.lora.enabled
        model_path = str(resume_from) if resume_from and not lora else resolve_model(cfg.model.ckpt)
        namespace = job_namespace(cfg.cluster.namespace, cfg.run_dir)
        marks = {**(marks or {}), "job_start": time.time()}  # when start-up milestones were reached (`startup/*`)
        import_meanwhile("jobs.placement")  # the actors' modules (torch, transformers) while Ray starts
        owns_ray = init_ray(cfg.cluster, namespace)
        marks["ray_ready"] = time.time()
        from jobs.placement import make_env_workers, place_actors  # noqa: PLC0415 (waits for that import)

        wait_for_stale_actors(namespace)
        placed = place_actors(cfg, model_path)
        learners, sources = placed.learners, placed.sources
        learner = learners[0]
        # the engines build while the learner ranks load and join their group, and the env workers start
        # (processes, imports) meanwhile too: they need only the engines' nodes
        nodes = ray.get([r.node_id.remote() for r in placed.rollouts])
        marks["actors_up"] = time.time()
        starting = [r.start.remote() for r in placed.rollouts]
        env_workers = make_env_workers(cfg.env, nodes=nodes)
        try:
            if len(learners) > 1:
                ip, port = ray.get(learner.address.remote())
                ray.get([rank.init_distributed.remote(r, len(learners), f"tcp://{ip}:{port}")
                         for r, rank in enumerate(learners)])
            prompt, continuation = canary_sequence(model_path)  # the driver's own tokenizer load, meanwhile
            infos = ray.get(starting)
            marks["engines_ready"] = time.time()
        except BaseException:  # an engine that fails to build: the workers started for it go too
            for worker in env_workers:
                ray.kill(worker, no_restart=True)
            raise
        feeders = placed.feeders or [[r] for r in sources]
        bucket_bytes = cfg.sync.bucket_mb << 20
        plan = route_weights(cfg.sync.transport, learners, placed.rollouts, feeders, infos, bucket_bytes)
        transports = [route.transport for route in plan.routes]
        proxies = [{**info, "transport": t, "actor": r} for info, t, r in zip(infos, transports, placed.rollouts)]
        print(f"rlsys: {len(learners)} learner rank(s), {len(infos)} engine(s); weights by "
              f"{', '.join(sorted(set(transports)))}", flush=True)
        num_params = ray.get(learner.num_parameters.remote())
        marks["learner_ready"] = time.time()
        sleep_level, why = choose_sleep_level(cfg, model_path, infos)
        print(f"rlsys: engines {'stay awake' if sleep_level == 0 else f'sleep at level {sleep_level}'} while the "
              f"learner trains ({why})", flush=True)
        weights = WeightSync(
            learners=learners, engines=placed.rollouts, feeds=plan.feeds(), expected_count=num_params,
            canary_prompt=prompt, canary_continuation=continuation, canary_tol=cfg.sync.canary_tol or placed.canary_tol,
            canary_enabled=cfg.sync.canary, canary_every=cfg.sync.canary_every, fingerprint=cfg.sync.fingerprint,
            canary_follow=placed.canary_follow, routes=plan.routes,
        )
        data = ItemStream(items, seed=cfg.seed, shuffle=cfg.data.shuffle, replay_frac=cfg.data.signal_replay)
        env = cfg.env.environment()
        wants_eval = cfg.eval.at_start or cfg.eval.at_end or cfg.eval.every
        job = cls(cfg=cfg, namespace=namespace, owns_ray=owns_ray, learners=learners, rollouts=placed.rollouts,
                  proxies=proxies, env_workers=env_workers, engines=EngineGroup(placed.rollouts), weights=weights,
                  data=data, model_path=model_path, eval_items=eval_items if wants_eval else [],
                  outcome_labels=env.outcomes, env=env, placement_group=placed.placement_group,
                  startup_marks=marks, sleep_level=sleep_level, reference=placed.reference)
        if resume_from is not None:
            ray.get([rank.load_state.remote(str(resume_from)) for rank in learners])
            data.load_state_dict(trainer_state["data"])
            job.start_step = int(trainer_state["step"])
            job.weights.push()  # after a resume, the weights reach the engine before the first rollout
            job.engines.wake()
            print(f"rlsys: resumed from {resume_from} at step {job.start_step}", flush=True)
        job.weights.check_canary()  # engine and learner start from the same weights
        marks["canary_passed"] = time.time()
        return job

    @property
    def learner(self) -> Any:
        """Rank 0: the learner that reports metrics, scores the canary and writes checkpoints."""
        return self.learners[0]

    # --- phases ----------------------------------------------------------------------------
    def rollout_until_full(self, step: int) -> tuple[list[Any], list[TrajectorySummary], dict[str, float]]:
        """The step's rollout phase: `rollout.batch_size` boards from the data cursor, every sample of each at once;
        under `algo.dynamic_sampling` as many more as the recent share of groups with signal calls for
        (`data.signal_rate`, at most `algo.max_oversample` per group), the groups whose rewards all agree are dropped
        and rounds of more boards are sampled until the batch holds `batch_size` groups with signal or
        `algo.max_sample_rounds` rounds were sampled (rlsys/sampling.py). Every fresh board sampled advances the
        cursor, so a resumed run goes on after them; under `data.signal_replay` the boards whose group had signal
        are queued to come back sooner (the queue is saved with the cursor; `rollout/boards_replayed` counts the
        boards drawn from it).

        Returns the trajectory refs to train on (the kept groups), the summaries of *every* trajectory sampled
        (the step's rollout metrics and error table describe what was sampled) and the `rollout/groups_*` counts."""
        a = self.cfg.algo
        sieve = GroupSieve(want=self.cfg.rollout.batch_size, max_rounds=a.max_sample_rounds,
                           max_oversample=a.max_oversample, mask_truncated=a.mask_truncated,
                           truncated_penalty=a.truncated_penalty, enabled=a.dynamic_sampling,
                           unanimous=a.unanimous_groups, unanimous_pick=a.unanimous_order())
        refs: list[Any] = []
        summaries: list[TrajectorySummary] = []
        drawn: list[dict[str, Any]] = []  # group g's board is drawn[g]
        boards, replayed = sieve.first_round(self.data.signal_rate), self.data.replayed
        while boards:  # a round: all its boards' episodes submitted at once
            drawn += self.data.next_batch(boards)
            more_refs, more = self.rollout(drawn[sieve.groups_seen:], step, first_group=sieve.groups_seen)
            refs += more_refs
            summaries += more
            sieve.add(more)
            boards = sieve.next_round()
        self.data.replay([drawn[g] for g in sieve.with_signal])  # `data.signal_replay`: drawn again sooner
        self.data.signal_rate = next_signal_rate(self.data.signal_rate, sieve.signal_share())
        keep = sieve.kept()
        counts = sieve.metrics() if a.name != "sft" else {}  # an SFT "group" is one example: nothing to count
        counts["rollout/boards_replayed"] = float(self.data.replayed - replayed)
        if a.dynamic_sampling:
            counts["rollout/signal_rate"] = self.data.signal_rate  # sizes the next step's first round
        if not keep:
            print(f"rlsys: dynamic sampling: none of {sieve.groups_seen} groups sampled in {sieve.rounds} round(s) "
                  "has rewards that differ; this step's update is skipped (raise algo.max_sample_rounds or "
                  "algo.max_oversample, or check the reward)", flush=True)
        return self.with_reference([r for r, s in zip(refs, summaries) if s.group in keep]), summaries, counts

    def with_reference(self, refs: list[Any]) -> list[Any]:
        """``refs`` as the reference actor returns them, its logprobs added (`learner.reference_actor`): refs to
        results still being computed, which the learner's `train` waits for; ``refs`` themselves without one."""
        if self.reference is None or not refs:
            return refs
        out = self.reference.annotate.options(num_returns=len(refs)).remote(*refs)
        return [out] if len(refs) == 1 else out

    def rollout(self, items: list[dict[str, Any]], step: int,
                first_group: int = 0) -> tuple[list[Any], list[TrajectorySummary]]:
        """Every (item, sample) episode on the env workers; returns trajectory refs and their summaries. Item i is
        group ``first_group + i`` (a top-up round's groups continue the step's numbering).

        For `--algo sft` an episode is an SFT chat rendered by the model's template, not an agent run."""
        if self.cfg.algo.name == "sft":
            return self._episodes(items, 1, sft_calls(self.model_path), first_group, generates=False)
        return self._episodes(items, self.cfg.rollout.n_samples, agent_calls(
            lambda g, s: f"seed{self.cfg.seed}-step{step}-item{g}-sample{s}"), first_group)

    def evaluate(self, tag: str, examples_path: Path | None = None) -> dict[str, float]:
        """Held-out episodes at `eval.temperature` (greedy by default) through `rlsys eval`'s path
        (`jobs.eval.evaluate_held_out`); metrics under `eval/` (`eval/<variant>/` for `eval.perturb`'s variants).
        ``examples_path``: also write a few episodes of each outcome there as JSON (`collect_examples`), the
        model's answers that the metrics only count."""
        if not self.eval_items:
            return {}
        ray.get([r.set_temperature.remote(self.cfg.eval.temperature) for r in self.rollouts])
        try:
            held_out = evaluate_held_out(self.env_workers, self.proxies, self.eval_items,
                                         eval_variants(self.env, self.cfg.eval.perturb), self.cfg.eval.n_samples,
                                         self.env, tag=tag, progress=self.cfg.logging.progress)
        finally:
            ray.get([r.set_temperature.remote(None) for r in self.rollouts])
        if examples_path is not None:
            examples = collect_examples(held_out.traj_refs, held_out.summaries, held_out.episodes,
                                        self.cfg.eval.n_samples, by_outcome=True)
            examples_path.parent.mkdir(parents=True, exist_ok=True)
            examples_path.write_text(json.dumps({"tag": tag, "by_outcome": examples}, indent=1, default=str))
        metrics: dict[str, float] = {}
        for v, result in held_out.variants.items():  # the driver keeps only the summed-up metrics
            metrics.update(result.flat("eval/" if v == DEFAULT_VARIANT else f"eval/{v}/"))
        return metrics

    def _episodes(self, items: list[dict[str, Any]], n: int, submit, first_group: int = 0,
                  generates: bool = True) -> tuple[list[Any], list[TrajectorySummary]]:
        return run_episodes(self.env_workers, self.proxies, items, n, submit, progress=self.cfg.logging.progress,
                            first_group=first_group, generates=generates)

    def train(self, traj_refs: list[Any], summaries: list[TrajectorySummary]) -> dict[str, float]:
        """One update on ``traj_refs``; ``summaries`` (of every trajectory sampled) decide a skip for failures. No
        refs (dynamic sampling kept no group): skipped, `train/skipped_batch` 1."""
        if not traj_refs:
            return {"train/skipped_batch": 1.0}
        failed = sum(s.failed for s in summaries) / max(len(summaries), 1)
        if failed > self.cfg.env.max_failed_frac:
            print(f"rlsys: WARNING step skipped: {failed:.0%} of trajectories failed "
                  f"(env.max_failed_frac={self.cfg.env.max_failed_frac})", flush=True)
            return {"train/skipped_batch": 1.0}
        per_rank = ray.get([rank.train.remote(traj_refs) for rank in self.learners])
        stats = per_rank[0]  # rank 0's view
        digests = [r.pop("train/weights_digest") for r in per_rank if "train/weights_digest" in r]
        if len(digests) > 1:  # data parallel: every rank took the same step, so the weights must be bit-equal
            spread = max(abs(d - digests[0]) for d in digests)
            stats["train/rank_weight_spread"] = spread
            if spread:
                print(f"rlsys: WARNING learner ranks' weights differ after this step (digests {digests}): "
                      "a rank missed a gradient all-reduce or an optimizer step", flush=True)
        return {**stats, "train/skipped_batch": 0.0}

    # --- checkpoints (weights; the full resumable state arrives with the reliability work) --
    def maybe_checkpoint(self, step: int, data_state: dict[str, Any] | None = None) -> None:
        every = self.cfg.checkpoint.save_interval
        if every and step % every == 0 and step < self.cfg.max_steps:
            self.checkpoint(step, data_state=data_state)

    def checkpoint(self, step: int, final: bool = False, data_state: dict[str, Any] | None = None) -> Path:
        """Learner state + data cursor + step + config, written atomically (rlsys/checkpoint.py). ``data_state``:
        the cursor to save instead of the current one (`rollout.overlap`: from before a rollout sampled ahead)."""
        root = self.cfg.checkpoint_dir()
        tmp = ckpt.new_temp_dir(root, step)
        ray.get(self.learner.save_state.remote(str(tmp)))
        dump_config(self.cfg, tmp / "config.resolved.toml")
        state = {"step": step, "data": data_state or self.data.state_dict(), "seed": self.cfg.seed}
        path = ckpt.finalize(tmp, root, step, state, keep=self.cfg.checkpoint.keep)
        if final:
            print(f"rlsys: checkpoint {path}", flush=True)
        return path

    def shutdown(self) -> None:
        for actor in self.rollouts:
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception as err:  # shutting down anyway; say why it was not clean
                print(f"rlsys: rollout shutdown: {type(err).__name__}: {err}", flush=True)
        for actor in [*self.learners, *self.rollouts, *self.env_workers, *([self.reference] if self.reference else [])]:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:  # free the GPU bundles for the next job in this Ray session
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
