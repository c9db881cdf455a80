"""`rlsys tune`: settings of a job that fit a GPU memory budget (like AReno's --tune-params), from the estimate
in rlsys/memory.py; no GPU needed.

    rlsys tune --config configs/tictactoe-tiny-cpu.toml --ckpt MODEL --gpu-memory-budget-gib 24

Prints the estimate of the config as given, and if it does not fit (or fits with room to spare) the settings
that look fastest within the budget: gradient checkpointing, 8-bit Adam, the micro-batch (`learner.mini_bs`,
a divisor of the sequences per optimizer step), the engine's concurrent sequences (`rollout.engine_max_batch`,
up to the episodes of a step) and, when the prompt length is known, a tighter `rollout.max_model_len`. Then the
`rlsys train` command line to use: the flags and dotted overrides given here, the proposed values in their place.
The prompt length is measured on the environment's requests when its agent sends one per episode
(`Environment.first_request`; `rlsys train` measures it the same way for its check), or given with
`--prompt-tokens`; otherwise (and, with a warning, where the model has no tokenizer or chat template to measure with)
every sequence is assumed `max_model_len` long (the worst case).
Exit status: 0 when something fits, 2 when nothing does (or the input is bad, as a `rollout.kv_cache_gib` too small
for one `max_model_len` sequence, which `rlsys train` refuses).
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import replace
from typing import Any

from jobs.items import PromptsNotMeasured, measured_prompt_tokens
from rlsys.budget import kv_cache_refusal, suggest
from rlsys.config import FLAGS, Config, add_config_args, config_from_args
from rlsys.errors import UserInputError
from rlsys.memory import GIB, SUGGEST_MARGIN, JobShape, ModelShape, estimate, read_model_config, trained_groups


def prompt_tokens_or_worst_case(cfg: Config, model_path: str) -> int | None:
    """`measured_prompt_tokens`, or None with a warning where the model has no tokenizer to measure with: every
    sequence is then counted `max_model_len` long, as `rlsys train`'s check counts it for the same model."""
    try:
        return measured_prompt_tokens(cfg, model_path)
    except PromptsNotMeasured as err:
        print(f"rlsys tune: WARNING {err}. Not measured: every sequence is counted max_model_len long (the worst "
              "case, as rlsys train's check counts it); --prompt-tokens N gives the length", file=sys.stderr)
        return None


def tighter_max_model_len(job: JobShape, prompt_tokens: int | None, max_new_tokens: int) -> int | None:
    """prompt + max_new_tokens with a quarter of headroom, rounded up to 128; None if not below the current."""
    if prompt_tokens is None:
        return None
    length = int(math.ceil((prompt_tokens + max_new_tokens) * 1.25 / 128) * 128)
    return length if length < job.max_model_len else None


def tune(cfg: Config, model_path: str, budget_gib: float, prompt_tokens: int | None = None,
         config_path: str | None = None, flags: dict[str, Any] | None = None,
         overrides: list[str] | None = None) -> tuple[int, str]:
    """(exit status, report) for ``cfg`` under ``budget_gib``; ``config_path``, ``flags`` and ``overrides`` are what
    the user gave (`add_config_args`), which the suggested `rlsys train` command gives back."""
    shape = ModelShape.from_config(read_model_config(model_path))
    job = JobShape.from_config(cfg, prompt_tokens)
    r = cfg.rollout
    episodes = job.concurrency  # in flight at once (a dynamic-sampling round at its largest)
    per_minibatch = trained_groups(cfg) * job.n_samples // cfg.algo.n_minibatches
    prompt = f"{prompt_tokens}-token prompts" if prompt_tokens else "prompt length unknown: sequences of max_model_len"
    lines = [f"rlsys tune: {model_path}, budget {budget_gib:g} GiB, {episodes} episodes in flight, "
             f"{per_minibatch} sequences per optimizer step, {prompt}", "", "as configured:"]
    current = estimate(shape, job, budget_gib)
    lines.append(current.table())
    lines.append(f"  -> {'fits' if current.fits else 'does NOT fit'}")
    # the estimate is the vLLM engine's: its fixed KV cache is checked as rlsys train checks it (jobs/items.py
    # `check_kv_cache`) unless the config names the transformers engine, which ignores kv_cache_gib
    kv_checked, tp = r.engine != "transformers", cfg.cluster.tp_size
    kv_refusal = kv_cache_refusal(shape, job, tp) if kv_checked else None
    if kv_refusal:
        lines.append(f"  -> and rlsys train refuses it: {kv_refusal}")
    proposal = suggest(shape, job, budget_gib, per_minibatch=per_minibatch, max_concurrency=episodes)
    tighter = tighter_max_model_len(job, prompt_tokens, r.max_new_tokens)
    if tighter is not None:
        shorter = suggest(shape, replace(job, max_model_len=tighter), budget_gib, per_minibatch=per_minibatch,
                          max_concurrency=episodes)
        if shorter is not None and (proposal is None or shorter.estimate.total_bytes < proposal.estimate.total_bytes
                                    and shorter.job.mini_bs >= proposal.job.mini_bs):
            shorter.changed["rollout.max_model_len"] = tighter
            proposal = shorter
        elif proposal is not None:
            lines.append(f"(rollout.max_model_len {tighter} would also do for these prompts; it saves no memory here)")
    # a prompt length given (not measured): the train command states it, so that its check and split agree
    given = {"rollout.budget_prompt_tokens": r.budget_prompt_tokens} if r.budget_prompt_tokens else {}
    flags = {**(flags or {}), "--ckpt": cfg.model.ckpt, "--gpu-memory-budget-gib": f"{budget_gib:g}"}
    if proposal is None and current.fits and not kv_refusal:  # rlsys train runs it as it is, with a thin margin
        lines.append(f"\nno settings fit with the {SUGGEST_MARGIN:.0%} of the budget a proposal leaves for what the "
                     f"estimate misses; as configured it fits, "
                     f"{(current.budget_bytes - current.total_bytes) / GIB:.2f} GiB to spare, and rlsys train runs it "
                     "(docs/performance.md: how close the estimate came to the measured peaks)")
        lines.append("use: " + train_command(config_path, flags, overrides or [], given))
        return 0, "\n".join(lines)
    if proposal is None:
        from rlsys.memory import minimum_bytes

        lines.append(f"\nnothing fits {budget_gib:g} GiB: even one sequence per micro-batch with checkpointing and "
                     f"8-bit Adam needs ~{minimum_bytes(shape, job) / GIB:.1f} GiB; raise the budget or use a "
                     "smaller model")
        return 2, "\n".join(lines)
    lines += ["", "proposed:", proposal.estimate.table(),
              f"  -> fits, {(proposal.estimate.budget_bytes - proposal.estimate.total_bytes) / GIB:.1f} GiB to spare"]
    if proposal.changed:
        lines.append("\nchanges: " + ", ".join(f"{k} {_value(getattr_dotted(cfg, k))} -> {_value(v)}"
                                                for k, v in proposal.changed.items()))
    else:
        lines.append("\nthe configuration as given is already the fastest that fits")
    if kv_checked and (refusal := kv_cache_refusal(shape, proposal.job, tp)):
        same = proposal.job.max_model_len == job.max_model_len
        lines.append(f"\nno command to use: {'rollout.kv_cache_gib is refused (above)' if same else refusal}")
        return 2, "\n".join(lines)
    lines.append("use: " + train_command(config_path, flags, overrides or [], {**proposal.changed, **given}))
    return 0, "\n".join(lines)


def train_command(config_path: str | None, flags: dict[str, Any], overrides: list[str], tuned: dict[str, Any]) -> str:
    """The `rlsys train` command line of the job tuned: the user's ``config_path``, ``flags`` (`FLAGS` name -> value,
    True for a switch) and dotted ``overrides`` in their order, with the ``tuned`` values (dotted key -> value) in
    place of the user's for the same key and after them for the rest. No key twice: a flag whose key an override
    names is left out (the override wins in `load_config` anyway), an override given twice keeps its last value."""
    settings: dict[str, str] = {}  # dotted key -> value as written, in the order first given
    for item in overrides:
        key, _, raw = item.partition("=")
        settings[key.strip()] = raw
    settings.update({key: _value(value) for key, value in tuned.items()})
    words = ["--config", config_path] if config_path else []
    for flag in FLAG_ORDER:
        value = flags.get(flag)
        if value is None or value is False or FLAGS[flag][0] in settings:
            continue
        words += [flag] if value is True else [flag, str(value)]
    words += [f"{key}={raw}" for key, raw in settings.items()]
    return "rlsys train " + shlex.join(words)


# the flags' order in the suggested command: --ckpt first and the budget last, as tune's own usage line has them
FLAG_ORDER = ["--ckpt", *(f for f in FLAGS if f not in ("--ckpt", "--gpu-memory-budget-gib")),
              "--gpu-memory-budget-gib"]


def getattr_dotted(cfg: Config, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsys tune", description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--prompt-tokens", type=int, help="prompt length in tokens, i.e. rollout.budget_prompt_tokens "
                        "(default: measured for a single-request environment, as rlsys train measures it; else "
                        "sequences are assumed max_model_len long)")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        budget = cfg.rollout.gpu_memory_budget_gib
        if budget is None:
            raise UserInputError("rlsys tune needs a budget: --gpu-memory-budget-gib GIB")
        from rlsys.models.resolve import resolve_model

        model_path = resolve_model(cfg.model.ckpt)
        if args.prompt_tokens:
            cfg.rollout.budget_prompt_tokens = args.prompt_tokens
        prompt = cfg.rollout.budget_prompt_tokens or prompt_tokens_or_worst_case(cfg, model_path)
        flags = {flag: getattr(args, "flag:" + flag) for flag in FLAGS}
        status, report = tune(cfg, model_path, budget, prompt, args.config, flags, list(args.overrides or []))
    except UserInputError as err:
        print(f"rlsys: {err}", file=sys.stderr)
        return 2
    print(report)
    return status


if __name__ == "__main__":
    sys.exit(main())
