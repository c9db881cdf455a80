"""The frozen KL reference in a process of its own (`learner.reference_actor`).

A plain class (testable without Ray); jobs/placement.py wraps it with `ray.remote`. The driver hands it each rollout
batch as soon as it is sampled (`Job.with_reference`); `annotate` adds the reference's logprob of every token to
the trajectories' segments (`Segment.ref_logprobs`) and returns them, one object per trajectory, which the learner then
takes instead of the batch the env workers returned: its micro-batches read the reference's logprobs from the rows
(`Learner._ref_logprobs`) rather than running the reference forward before their own. The forward takes the
learner's path: rows ordered by prompt (`prompt_order`), micro-batches of `learner.mini_bs` (or
`micro_batch_tokens`), prefix sharing and the common prefix pass as the learner has them (`prefix_settings`), the
model `model.ckpt` in the compute dtype (`load_reference`).
"""
from __future__ import annotations

import torch

from actors.learner_rows import Row, collate, micro_batches, prefix_settings, prompt_order, row_logprobs
from actors.learner_setup import LearnerSettings, cpu_process_settings, load_reference, pick_device, resolve_dtype
from rlsys.types import Trajectory


class Reference:
    def __init__(self, cfg: LearnerSettings, *, num_threads: int | None = None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.device = pick_device()
        cpu_process_settings(self.device)  # the learner's CPU settings: its attention path, its kept heap
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.model = load_reference(cfg.model, cfg.algo.kl_coef, self.device, self.dtype)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.sharing, self.common = prefix_settings(cfg.learner, cfg.algo.name, self.model, self.device)

    @torch.no_grad()
    def annotate(self, *trajectories: Trajectory) -> Trajectory | tuple[Trajectory, ...]:
        """``trajectories`` with `ref_logprobs` filled in on every segment the learner may train on (sampled tokens,
        not failed; in place), returned in order: one value per trajectory (Ray's `num_returns`), the trajectory
        itself for one."""
        rows = [Row(seg, 0.0, t.group) for t in trajectories if not t.failed for seg in t.segments if seg.num_sampled]
        rows = prompt_order(rows, self.sharing, self.cfg.learner.length_order)
        for micro in micro_batches(rows, self.cfg.learner.mini_bs, self.cfg.learner.micro_batch_tokens):
            batch = collate(micro, self.pad_id, self.device)
            lp = row_logprobs(self.model, micro, batch, sharing=self.sharing, common=self.common).float().cpu()
            for row, row_lp in zip(micro, lp):  # (T-1,): position t holds the logprob of token t + 1
                n = len(row.segment.input_ids)
                row.segment.ref_logprobs = [0.0, *row_lp[: n - 1].tolist()]
        return trajectories[0] if len(trajectories) == 1 else trajectories
