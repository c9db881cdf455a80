"""The learner: a transformers causal LM trained with GSPO, GRPO or SFT on trajectories from the object store.

A plain class (testable without Ray); jobs/ wraps it with `ray.remote`. One `train` call = one rollout
batch = `algo.n_minibatches` optimizer steps, each over micro-batches of `learner.mini_bs` sequences (or of
`learner.micro_batch_tokens` padded positions) with gradient accumulation. Departures worth knowing:
- Sequences whose advantage is exactly 0 (zero-variance groups) contribute no gradient to GSPO/GRPO, so
  they are not run through the model at all; the loss normaliser still counts them, so the update is the
  same as computing them (and CPU runs get much faster once the policy is confident).
- A non-finite loss or grad norm skips that optimizer step (counted in train/skipped_steps), never NaNs
  the weights.
- Prefix sharing (`learner.prefix_sharing`, GSPO/GRPO): the samples of a group share their prompt, so the rows of
  a micro-batch with the same prompt run it forward once and only their answers on its KV cache
  (`rlsys/prefix.py`); rows are ordered by prompt before they are cut into micro-batches. Same logprobs, same
  gradients; `train/prefix_saved_frac` is the share of input tokens it did not run.
- `train/logp_diff_mean` compares the engine's sampling logprobs with the learner's recomputation on the
  first micro-batch before any update: the stale-weights alarm (docs/gpu.md, "Canary").
- `train/entropy` is the policy's mean token entropy over the sampled tokens the learner ran forward (from the
  same logits, chunked; `rlsys.algos.token_entropy`): the sequences with an advantage, or the first micro-batch
  on a step without any. `algo.entropy_coef` (a bonus) and `algo.kl_coef` (k3 KL to a frozen reference, logged
  as `train/kl_ref`) give zero-advantage sequences a gradient too, so with either set every sequence runs.
  The reference (`load_reference`) is the initial model `model.ckpt`, also when a resumed job's policy starts
  from a checkpoint: a resume reloads it from there, never from the checkpoint.
- `algo.entropy_target` (Skywork-OR1's adaptive entropy control, `rlsys.algos.EntropyController`): after each
  `train` call the entropy coefficient moves with that call's `train/entropy` (averaged over the ranks, so they
  all apply the same one); the next call applies it, logged as `train/entropy_coef`, and checkpoints keep it.
- LoRA (`learner.lora.enabled`, rlsys/lora.py): the model is the frozen base wrapped by peft; only the adapters
  are parameters of the optimizer, pushed (`export_weights`) and counted (`num_parameters`), and a checkpoint holds
  them in peft's format; `load_state` loads them back into the base the job started from.
"""
from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from actors.learner_rows import (Row, collate, micro_batches, pad_stack, prefix_settings, prompt_order,
                                 resolve_trajectories, row_logprobs, split_rows, weights_digest)
from actors.learner_setup import (LearnerSettings, MemoryProbe, apply_memory_budget, cpu_process_settings,
                                  load_reference, lr_lambda, make_optimizer, pick_device, release_cached_memory,
                                  resolve_dtype)
from rlsys.algos import (EntropyController, GRPOConfig, GSPOConfig, RegularizerConfig, decayed_kl_coef,
                         group_advantages, grpo_loss, gspo_loss, masked_mean, regularizer_loss, sft_loss,
                         token_entropy, token_logprobs, top_entropy_mask)
from rlsys.prefix import EntropyMode
from rlsys.sampling import training_reward
from rlsys.types import Segment, Trajectory
from rlsys.weights.buckets import DEFAULT_BUCKET_BYTES
from rlsys.weights.sender import BucketSender


LEARNER_STATE = "learner_state.pt"
TOKEN_MEAN_METRICS = ("train/entropy", "train/kl_ref")  # averaged over a minibatch's sampled tokens, not sequences

class Learner:
    def __init__(self, cfg: LearnerSettings, model_path: str, *, num_threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model_path = model_path
        self.device = pick_device()
        cpu_process_settings(self.device)  # native GQA in attention, freed memory kept (nothing on GPU)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)  # compute dtype (and the engine's)
        # fp32 master weights: parameters and updates in float32, forward/backward under autocast
        self.param_dtype = torch.float32 if cfg.learner.fp32_master else self.dtype
        if self.device.type == "cuda" and not cfg.learner.cudnn_attention:  # NaN gradients: the config's docstring
            torch.backends.cuda.enable_cudnn_sdp(False)
        # before any weight lands on the GPU
        self.memory_cap = apply_memory_budget(cfg.memory, cfg.budget_gib, self.device)
        self.lora = cfg.learner.lora if cfg.learner.lora.enabled else None
        self.peft_model = None  # with LoRA: the peft wrapper (adapter checkpoints); `model` is the model inside it
        if self.lora is not None:  # the frozen base wrapped by peft: the adapters are the only trainable parameters
            from rlsys.lora import load_lora_policy

            self.peft_model = load_lora_policy(model_path, self.lora, self.device, self.param_dtype,
                                               cfg.model.trust_remote_code, cfg.model.gradient_checkpointing)
            # the transformers model with peft's layers inside: its forward runs the adapters and takes the KV cache
            # arguments prefix sharing needs (the wrapper's forward hides them)
            self.model = self.peft_model.get_base_model()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.param_dtype, trust_remote_code=cfg.model.trust_remote_code
            ).to(self.device)
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, cfg.learner, self.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.learner, cfg.max_steps * cfg.algo.n_minibatches))
        self.optimizer_steps = 0
        # fp32 masters, and LoRA's float32 adapters -> the engine's dtype: the merge then casts nothing per layer
        cast = self.dtype if self.param_dtype != self.dtype or self.lora is not None else None
        self.sender = BucketSender(self.device, cast)  # the push's buckets and transports (`export_weights`)
        self._pushed_list: list[tuple[str, torch.Tensor]] | None = None  # `_pushed`, listed by its first call
        low, high = cfg.algo.clip_eps()
        self._gspo = GSPOConfig(clip_eps_low=low, clip_eps_high=high, tis_cap=cfg.algo.tis_cap)
        self._grpo = GRPOConfig(clip_eps_low=low, clip_eps_high=high, tis_cap=cfg.algo.tis_cap)
        # algo.entropy_target: the entropy coefficient adapts after each `train` call (`_adapt_entropy_coef`); the
        # first call applies algo.entropy_coef, the starting coefficient
        algo = cfg.algo
        self._entropy_ctl = (EntropyController(target=algo.entropy_target, step=algo.entropy_coef_step,
                                               max_coef=algo.entropy_coef_max, coef=algo.entropy_coef,
                                               active=algo.entropy_coef)
                             if algo.entropy_target is not None else None)
        self._reg = RegularizerConfig(entropy_coef=algo.entropy_coef, kl_coef=algo.kl_coef)
        # the frozen initial policy of the KL penalty; None when it is off, and with LoRA, whose reference is the
        # frozen base itself run with the adapters switched off (`_ref_logprobs`): no second copy of the weights
        # with `learner.reference_actor` the reference runs in its own actor, and the rows carry its logprobs
        self.ref_model = (load_reference(cfg.model, cfg.algo.kl_coef, self.device, self.dtype)
                          if cfg.algo.kl_coef and self.lora is None and not cfg.learner.reference_actor else None)
        self.rank, self.world_size = 0, 1
        self.prefix_sharing, self.common_prefix_pass = prefix_settings(cfg.learner, cfg.algo.name, self.model,
                                                                       self.device)
        self._tokens = [0, 0]  # input tokens [not run thanks to prefix sharing, in all] of this `train` call
        self._padding = [0, 0]  # positions of this `train` call's micro-batches [padded, in all]
        self._micro = 0  # micro-batches of this `train` call (forward + backward each)

    # --- data parallelism ------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group's rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def init_distributed(self, rank: int, world_size: int, init_method: str) -> None:
        """Join the learners' process group (NCCL on GPU, gloo on CPU). Every rank computes the whole
        batch's advantages, trains on its share of the sequences, and gradients are summed across ranks
        before each optimizer step, so all ranks take the same step and their weights stay equal."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        self.rank, self.world_size = rank, world_size
        for p in self.params:  # start from rank 0's weights, whatever each rank loaded
            dist.broadcast(p.data, src=0)

    def _reduce_gradients(self, loss_sum: float) -> float:
        """Sum gradients (flattened, one all-reduce) and the loss over ranks; no-op on one rank."""
        if self.world_size == 1:
            return loss_sum
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [torch.tensor([loss_sum], device=self.device)])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
        return float(flat[-1])

    # --- training ----------------------------------------------------------------------------
    def autocast(self):
        """Compute in `self.dtype` when the weights are fp32 masters of a 16-bit model; else a no-op."""
        import contextlib

        if self.param_dtype == self.dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def train(self, trajectories: Sequence[Any]) -> dict[str, float]:
        """One rollout batch -> `n_minibatches` optimizer steps. Accepts Trajectory objects or ObjectRefs.

        Besides the losses: `time/learner_fetch` (trajectories out of the object store), `time/learner_compute`
        (everything after, GPU work finished), and on a GPU the memory of this call (`mem/*`, GiB)."""
        t0 = time.perf_counter()
        trajs = resolve_trajectories(trajectories)
        t1 = time.perf_counter()
        probe = MemoryProbe(self.device)
        with self.autocast():
            out = self._train(trajs)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        compute_s = time.perf_counter() - t1
        release_cached_memory(self.device, self.cfg.learner.empty_cache)  # learner.empty_cache: after the peak
        out.update({"time/learner_fetch": t1 - t0, "time/learner_compute": compute_s, **probe.finish()})
        if self.world_size > 1:  # the driver compares the ranks' (they must stay bit-equal)
            out["train/weights_digest"] = weights_digest(self.params)  # outside learner_compute: one pass
        return out

    def _train(self, trajs: list[Trajectory]) -> dict[str, float]:
        if self.cfg.algo.name == "sft":
            rows = [Row(seg, 1.0, t.group) for t in trajs if not t.failed for seg in t.segments if seg.num_sampled]
            adv_metrics: dict[str, float] = {}
        else:
            rows, adv_metrics = self._policy_rows(trajs)
        if not rows:  # nothing trained, nothing measured: the entropy coefficient stays as it is
            empty = {**adv_metrics, "train/skipped_steps": 0.0, "train/num_sequences": 0.0}
            if self._entropy_ctl is not None:
                empty["train/entropy_coef"] = self._reg.entropy_coef
            return empty
        if self.cfg.algo.kl_decay is not None:  # the schedule follows the optimizer steps (a resume restores them)
            self._reg = replace(self._reg, kl_coef=decayed_kl_coef(self.cfg.algo.kl_coef, self.cfg.algo.kl_decay,
                                                                   self.optimizer_steps))
        chunks = split_rows(rows, self.cfg.algo.n_minibatches)
        self._last_trained: list[Segment] = []
        self._tokens = [0, 0]
        self._padding = [0, 0]
        self._micro = 0
        # "decoupled" with one optimizer step per batch: the weights that would recompute logp_old are the ones that
        # compute logp_new, so _minibatch takes logp_new, detached (ratio exactly 1), instead of a second forward.
        # The recompute ran other micro-batches whose bf16 rounding differed: ratios of 1 +- 4e-4 that the 3e-4
        # clip cut out of the gradient (up to 15% of a gsm step's sequences), for a forward of every row (about a
        # quarter of the learner's work: one forward against forward + backward).
        decoupled = self.cfg.algo.logp_mode == "decoupled"
        logp_old = self._recompute_old_logprobs(rows) if decoupled and len(chunks) > 1 else None
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        skipped = 0
        grad_norms = []
        lr = self.scheduler.get_last_lr()[0]  # the lr an optimizer step takes now (the scheduler steps after it)
        for i, chunk in enumerate(chunks):
            stats = self._minibatch(chunk, logp_old, first=i == 0)
            gnorm = stats.pop("train/grad_norm")
            if not math.isfinite(gnorm) or not math.isfinite(stats.get("train/loss", 0.0)):
                self._report_nonfinite(chunk, gnorm, stats.get("train/loss", 0.0))
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
            else:
                lr = self.scheduler.get_last_lr()[0]
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.optimizer_steps += 1
            grad_norms.append(gnorm)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
                weights[k] = weights.get(k, 0.0) + 1.0
        out = {k: totals[k] / weights[k] for k in totals}
        out.update(adv_metrics)
        out["train/grad_norm"] = grad_norms[-1] if len(grad_norms) == 1 else sum(grad_norms) / len(grad_norms)
        out["train/skipped_steps"] = float(skipped)
        out["train/lr"] = lr  # the lr this batch's last step used, not the scheduler's next one
        out["train/num_sequences"] = float(len(rows))
        out["train/optimizer_steps"] = float(self.optimizer_steps)
        if self.prefix_sharing:
            out["train/prefix_saved_frac"] = self._tokens[0] / max(self._tokens[1], 1)
        out["train/padded_frac"] = self._padding[0] / max(self._padding[1], 1)
        out["train/micro_batches"] = float(self._micro)
        if self.cfg.algo.kl_decay is not None:
            out["train/kl_coef"] = self._reg.kl_coef
        if self._entropy_ctl is not None:
            out["train/entropy_coef"] = self._reg.entropy_coef  # the one this call applied
            self._adapt_entropy_coef(out.get("train/entropy", math.nan))
        return out

    def _adapt_entropy_coef(self, entropy: float) -> None:
        """`algo.entropy_target`: move the entropy coefficient with this call's mean entropy, for the next call.
        On several ranks every rank takes part in one all-reduce of (entropy, 1) -- (0, 0) for a rank without a
        finite one, e.g. one whose share of the rows was empty -- so all ranks update with the same mean and keep
        applying the same coefficient (their weights must stay equal); none finite anywhere: no update."""
        if self.world_size > 1:
            import torch.distributed as dist

            finite = math.isfinite(entropy)
            both = torch.tensor([entropy if finite else 0.0, 1.0 if finite else 0.0], dtype=torch.float64,
                                device=self.device)  # (2,) [sum of entropies, ranks with one]
            dist.all_reduce(both)
            entropy = float(both[0] / both[1]) if float(both[1]) > 0 else math.nan
        self._entropy_ctl.update(entropy)
        self._reg = replace(self._reg, entropy_coef=self._entropy_ctl.active)

    def _report_nonfinite(self, chunk: list[Row], gnorm: float, loss: float) -> None:
        """One log line on a skipped optimizer step: which parameters got a non-finite gradient, and the lengths
        of the rows (a cause found this way: an attention kernel's NaN at some lengths, `learner.cudnn_attention`)."""
        bad = [name for name, p in self.model.named_parameters()
               if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        lengths = sorted({len(r.segment.input_ids) for r in chunk})
        print(f"rlsys: learner step skipped: loss {loss:.4g}, grad norm {gnorm}; {len(bad)} parameter tensors with a "
              f"non-finite gradient (first: {', '.join(bad[:3]) or 'none'}); row lengths {lengths[0]}..{lengths[-1]} "
              f"({sum(n % 128 == 64 for n in lengths)} of {len(lengths)} distinct lengths are 64 mod 128)", flush=True)

    def _policy_rows(self, trajs: list[Trajectory]) -> tuple[list[Row], dict[str, float]]:
        penalty = self.cfg.algo.truncated_penalty  # cut-off answers: less reward (rlsys/sampling.py)
        rewards = torch.tensor([training_reward(t, penalty) if not t.failed else 0.0 for t in trajs],
                               dtype=torch.float32)  # (N,)
        groups = torch.tensor([t.group for t in trajs], dtype=torch.long)  # (N,)
        valid = torch.tensor([not t.failed and t.response_len > 0 for t in trajs], dtype=torch.bool)  # (N,)
        masked = torch.tensor([self.cfg.algo.mask_truncated and t.truncated_turns > 0 for t in trajs],
                              dtype=torch.bool)  # (N,) cut at max_tokens: out of the baseline and the loss
        valid &= ~masked
        algo = self.cfg.algo
        adv, metrics = group_advantages(rewards, groups, valid, eps=algo.adv_eps, scale=algo.scale_advantages,
                                        unanimous=algo.unanimous_baseline, positive_weight=algo.positive_weight)
        metrics["adv/truncated_masked_frac"] = float(masked.float().mean()) if len(trajs) else 0.0
        if penalty:
            metrics["adv/truncated_penalized_frac"] = sum(t.truncated_turns > 0 and not t.failed
                                                          for t in trajs) / max(len(trajs), 1)
        # A multi-turn trajectory that broke into k segments is k rows: each carries A/k and weight 1/k, so
        # the trajectory counts once in the loss (scaling A by w > 0 commutes with GSPO's min/clip).
        rows = []
        for i, t in enumerate(trajs):
            segments = [seg for seg in t.segments if seg.num_sampled] if bool(valid[i]) else []
            rows += [Row(seg, float(adv[i]) / len(segments), t.group, 1.0 / len(segments)) for seg in segments]
        return rows, metrics

    def _minibatch(self, chunk: list[Row], logp_old: dict[int, torch.Tensor] | None, first: bool) -> dict[str, float]:
        """Forward/backward over micro-batches of one optimizer step; returns averaged metrics + grad norm."""
        algo = self.cfg.algo.name
        frac = self.cfg.algo.top_entropy_frac  # the loss on the highest-entropy share of the sampled tokens only
        # the regularizers' token-mean normaliser: the sampled tokens, or about the share of them trained on
        tokens = float(sum(r.segment.num_sampled for r in chunk)) * (1.0 if frac is None else frac)
        normalizer = sum(r.weight for r in chunk)  # trajectories, whatever their number of segments
        if algo == "grpo":  # token-mean over the whole minibatch
            normalizer = tokens
        local = chunk[self.rank :: self.world_size]  # this rank's share; normalisers count the whole chunk
        # an entropy bonus or a KL penalty moves zero-advantage sequences too
        regularized = bool(self._reg.entropy_coef or self._reg.kl_coef)
        active = [r for r in local if algo == "sft" or regularized or r.advantage != 0.0]
        self._last_trained += [r.segment for r in active]
        active = self._by_prompt(active)
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        loss_sum = 0.0
        for index, micro in enumerate(self._micro_batches(active)):
            self._micro += 1
            batch = collate(micro, self.pad_id, self.device)
            self._padding[0] += batch["input_ids"].numel() - sum(len(r.segment.input_ids) for r in micro)
            self._padding[1] += batch["input_ids"].numel()
            targets = batch["input_ids"][:, 1:]  # (B, T-1)
            mask = batch["loss_mask"][:, 1:]  # (B, T-1)
            if algo == "sft":
                out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
                # (B, T-1, V): logits[:, t] predicts input_ids[:, t+1]. In the model's dtype: sft_loss and
                # token_entropy read it in float32 chunks (no float32 copy kept for backward, as rlsys/prefix.py)
                logits = out.logits[:, :-1]
                loss, m = sft_loss(logits, targets, mask, normalizer=float(sum(r.segment.num_sampled for r in chunk)))
                with torch.no_grad():
                    m["train/entropy"] = float(masked_mean(token_entropy(logits), mask))
            else:
                # the reference first: its no-grad forward is freed before the policy's graph exists
                logp_ref = self._ref_logprobs(micro, batch)  # (B, T-1), None without a KL penalty
                logp_new, entropy = self._token_logprobs(micro, batch, entropy="grad" if self._reg.entropy_coef
                                                         else "no_grad")  # (B, T-1) each
                rollout_lp = batch["rollout_logprobs"][:, 1:]  # (B, T-1)
                if logp_old is not None:  # decoupled, recomputed before the first of several optimizer steps
                    old = pad_stack([logp_old[id(r)] for r in micro], self.device)[:, : targets.shape[1]]
                    tis_ref = rollout_lp
                elif self.cfg.algo.logp_mode == "decoupled":  # one optimizer step: this forward is logp_old
                    old, tis_ref = logp_new.detach(), rollout_lp
                else:  # bypass
                    old, tis_ref = rollout_lp, None
                adv = torch.tensor([r.advantage for r in micro], device=self.device)  # (B,)
                loss_fn, lcfg = (gspo_loss, self._gspo) if algo == "gspo" else (grpo_loss, self._grpo)
                trained = mask if frac is None else top_entropy_mask(mask, entropy, frac)  # (B, T-1)
                loss, m = loss_fn(logp_new, old, adv, trained, lcfg, logp_rollout=tis_ref, normalizer=normalizer)
                reg, reg_m = regularizer_loss(trained, self._reg, entropy=entropy, logp_new=logp_new, logp_ref=logp_ref,
                                              normalizer=tokens)
                if frac is not None:
                    m["train/selected_token_frac"] = float(trained.sum()) / max(float(mask.sum()), 1.0)
                loss, m = loss + reg, {**m, **reg_m}
                if first and index == 0:
                    with torch.no_grad():
                        diff = (rollout_lp - logp_new).abs()
                        m["train/logp_diff_mean"] = float((diff * mask).sum() / mask.sum().clamp(min=1))
                        m["train/logp_diff_max"] = float((diff * mask).max())
            loss.backward()
            # the micro-batch losses carry the minibatch normaliser: their sum is the minibatch loss
            loss_sum += float(loss.detach())
            for k, v in m.items():
                if k == "train/loss" or (k.startswith("train/logp_diff") and k in sums):
                    continue
                weight = 1.0 if k.startswith("train/logp_diff") else len(micro)
                if k in TOKEN_MEAN_METRICS:  # token means of the micro-batch: weighed by its sampled tokens
                    weight = float(mask.sum())
                sums[k] = sums.get(k, 0.0) + float(v) * weight
                counts[k] = counts.get(k, 0.0) + weight
        loss_sum = self._reduce_gradients(loss_sum)
        if first and algo != "sft" and not active and local:  # keep the stale-weights alarm without signal
            idle = self._logp_diff(self._micro_batches(local)[0])  # and the entropy, on the same forward
            sums.update(idle)
            counts.update({k: 1.0 for k in idle})
        stats = {k: v / counts[k] for k, v in sums.items()}
        if algo != "sft":  # no sequence with a signal: nothing moved, nothing was clipped
            for key, idle in (("train/ratio_mean", 1.0), ("train/ratio_std", 0.0), ("train/clip_frac", 0.0),
                              ("train/clip_frac_low", 0.0), ("train/clip_frac_high", 0.0)):
                stats.setdefault(key, idle)
        stats["train/loss"] = loss_sum
        stats["train/active_frac"] = len(active) / max(len(local), 1)
        # the norm first, clipping only when it is finite: a NaN norm would turn every gradient into NaN, and the
        # skipped step's report (`_report_nonfinite`) names the parameters whose own gradient was not finite
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        stats["train/grad_norm"] = float(norm)
        if math.isfinite(stats["train/grad_norm"]):
            torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.learner.max_grad_norm, norm)
        return stats

    @torch.no_grad()
    def _logp_diff(self, micro: list[Row]) -> dict[str, float]:
        """|engine sampling logprob - learner logprob| and the policy's entropy over the sampled tokens of ``micro``."""
        batch = collate(micro, self.pad_id, self.device)
        lp, entropy = self._token_logprobs(micro, batch, entropy="no_grad")  # (B, T-1) each
        mask = batch["loss_mask"][:, 1:]
        diff = (batch["rollout_logprobs"][:, 1:] - lp).abs() * mask
        return {"train/logp_diff_mean": float(diff.sum() / mask.sum().clamp(min=1)), "train/logp_diff_max": float(diff.max()),
                "train/entropy": float(masked_mean(entropy, mask))}

    @torch.no_grad()
    def _recompute_old_logprobs(self, rows: list[Row]) -> dict[int, torch.Tensor]:
        self.model.eval()
        out = {}
        for micro in self._micro_batches(self._by_prompt(rows)):
            batch = collate(micro, self.pad_id, self.device)
            lp = self._token_logprobs(micro, batch)  # (B, T-1)
            for r, row_lp in zip(micro, lp):
                out[id(r)] = row_lp
        self.model.train()
        return out

    def _token_logprobs(self, micro: list[Row], batch: dict[str, torch.Tensor], entropy: EntropyMode = None,
                        model: torch.nn.Module | None = None) -> Any:
        """(B, T-1) logprobs of each row's tokens (loss-masked ones exact), shared prompts run once if on; with
        `entropy`, a pair (logprobs, entropies). `model` defaults to the policy (the reference passes its own)."""
        policy = model is None  # the reference's forward is not counted in train/prefix_saved_frac
        return row_logprobs(self.model if policy else model, micro, batch, sharing=self.prefix_sharing,
                            common=self.common_prefix_pass, entropy=entropy, counts=self._tokens if policy else None)

    @torch.no_grad()
    def _ref_logprobs(self, micro: list[Row], batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """(B, T-1) logprobs of the frozen reference (None without `algo.kl_coef`): same path as the policy's, or
        those the reference actor computed (`learner.reference_actor`), which the rows then carry."""
        if self.cfg.learner.reference_actor:  # the config names the source; rows' values are not read otherwise
            if "ref_logprobs" not in batch:
                raise RuntimeError("learner.reference_actor: a batch came without the reference actor's logprobs")
            return batch["ref_logprobs"][:, 1:]
        if self.cfg.algo.kl_coef and self.peft_model is not None:  # LoRA: the base is the reference
            with self.peft_model.disable_adapter():
                return self._token_logprobs(micro, batch, model=self.model).float()
        if self.ref_model is None:
            return None
        return self._token_logprobs(micro, batch, model=self.ref_model).float()

    def _micro_batches(self, rows: list[Row]) -> list[list[Row]]:
        return micro_batches(rows, self.cfg.learner.mini_bs, self.cfg.learner.micro_batch_tokens)

    def _by_prompt(self, rows: list[Row]) -> list[Row]:
        return prompt_order(rows, self.prefix_sharing, self.cfg.learner.length_order)

    # --- weights out ---------------------------------------------------------------------------
    def open_transports(self, transports: list[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """The transports this rank exports by (rlsys.weights.transport `WeightTransport`s, from the job's route plan:
        rlsys/weights/routes.py), given once at job start and kept for the learner's lifetime: cuda_ipc makes each
        buffer's handle once, collective keeps its joined group. ``bucket_bytes``: the buckets' size."""
        self.sender.open(transports, bucket_bytes)

    def export_weights(self) -> Any:
        """What a push carries (`_pushed`) packed into reusable buckets (allocated on the first call, refilled
        afterwards), turned into each opened transport's payload: a tuple of them in `open_transports` order, or the
        payload itself when there is one transport (rlsys/weights/sender.py)."""
        return self.sender.export(self._pushed())

    def send_weights(self) -> None:
        """After `export_weights`, while the engines load: what the transports send beside their payloads (the
        collective's broadcasts; nothing for the others)."""
        self.sender.send()

    def device_where(self) -> dict[str, Any]:
        """Where this rank's weights live: node, Ray's GPU ids, whether on CUDA and the GPU's uuid (the driver's
        choice of transport reads it)."""
        import ray

        from rlsys.weights.transport import gpu_uuid

        on_gpu = self.device.type == "cuda"
        return {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "on_gpu": on_gpu, "gpu_uuid": gpu_uuid(self.device) if on_gpu else None}

    def ipc_collect(self) -> None:
        """After the engines answered a push: free CUDA memory the engines no longer map (a no-op while the
        packer's buffers, which are reused every push, stay alive)."""
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()

    def weights_fingerprint(self) -> dict[str, int] | None:
        """{tensor name: exact sum of its bits} over the buckets of the last `export_weights`, the very bytes the
        engines were sent (rlsys/weights/fingerprint.py); None before the first export."""
        return self.sender.fingerprint()

    def num_parameters(self) -> int:
        """How many tensors a push carries (tied weights once; with LoRA, the adapters' A and B matrices)."""
        return len(self._pushed())

    def _pushed(self) -> list[tuple[str, torch.Tensor]]:
        """What a push carries: every parameter by its HF name, or with LoRA only the adapters
        (`<module>.lora_A` / `.lora_B`, rlsys/lora.py `adapter_tensors`). Listed once: the parameters are made in
        `__init__` and only ever written in place (steps, `load_state`), and walking a 7B peft model's 731
        parameters for its 392 adapters took 3.9 ms a push (CPU, meta tensors)."""
        if self._pushed_list is None:
            if self.lora is not None:
                from rlsys.lora import adapter_tensors

                self._pushed_list = adapter_tensors(self.model)
            else:
                self._pushed_list = list(self.model.named_parameters())
        return self._pushed_list

    def trainable_names(self) -> list[str]:
        """Names (as `named_weights` gives them) of the parameters the optimizer updates."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def score(self, prompt_ids: list[int], continuation_ids: list[int]) -> list[float]:
        """Raw logprobs (C,) of a continuation under the current weights (the canary's reference)."""
        self.model.eval()
        ids = torch.tensor([prompt_ids + continuation_ids], device=self.device)
        with self.autocast():
            logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        lp = token_logprobs(logits, ids[:, 1:])[0, len(prompt_ids) - 1 :]
        self.model.train()
        return lp.tolist()

    def last_trained(self) -> list[Segment]:
        """The segments the last `train` call ran through the model (tests check them token for token)."""
        return list(getattr(self, "_last_trained", []))

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}

    def save_state(self, path: str | Path) -> None:
        """Everything needed to continue exactly: HF weights + tokenizer (a loadable model folder; with LoRA the
        adapter in peft's format, `rlsys export --merge` makes the model folder) and optimizer (8-bit states
        included), scheduler, step counter, RNG states and, with `algo.entropy_target`, the adapted coefficient."""
        from transformers import AutoTokenizer

        self.save_pretrained(path)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python_rng": random.getstate(),
        }
        if self._entropy_ctl is not None:  # algo.entropy_target: the adapted coefficient, plain floats
            state["entropy_control"] = self._entropy_ctl.state_dict()
        torch.save(state, Path(path) / LEARNER_STATE)

    def load_state(self, path: str | Path) -> int:
        """Restore what `save_state` wrote (the weights were loaded from the same folder at start-up; with LoRA the
        base was, from `model.ckpt`, and the adapter is loaded here). Returns the optimizer step counter."""
        f = Path(path) / LEARNER_STATE
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {path}: {LEARNER_STATE} missing (not written by rlsys?)")
        if self.lora is not None:
            from rlsys.lora import load_adapter

            load_adapter(self.peft_model, path, self.lora)
        state = torch.load(f, map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])
        torch.set_rng_state(state["torch_rng"].cpu())
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            # loaded onto the learner's device with the rest; the generators take CPU byte tensors only (the GPU
            # resume test's first run: "RNG state must be a torch.ByteTensor")
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        random.setstate(state["python_rng"])
        # algo.entropy_target: a checkpoint written without it (older, or by a job without the option) leaves the
        # coefficient at its start, algo.entropy_coef
        if self._entropy_ctl is not None and state.get("entropy_control") is not None:
            self._entropy_ctl.load_state_dict(state["entropy_control"])
            self._reg = replace(self._reg, entropy_coef=self._entropy_ctl.active)
        return self.optimizer_steps

    def save_pretrained(self, path: str | Path) -> None:
        """The model folder (with LoRA: the adapter in peft's format)."""
        (self.peft_model or self.model).save_pretrained(path)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()
