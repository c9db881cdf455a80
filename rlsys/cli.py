"""The `rlsys` command. Each subcommand imports what it needs (Ray, jobs/) lazily, inside its handler,
so `rlsys --help` and `rlsys config` stay fast and work without Ray installed."""
from __future__ import annotations

import time

STARTED_AT = time.time()  # the `cli_started` start-up milestone: the interpreter is up, rlsys's imports begin

import argparse  # noqa: E402
import sys  # noqa: E402

from rlsys.config import add_config_args, config_from_args, describe_fields  # noqa: E402
from rlsys.errors import UserInputError  # noqa: E402


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    marks = {"cli_started": STARTED_AT, "config_loaded": time.time()}
    from jobs.train import run_training

    run_training(cfg, marks)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    if args.describe:
        for name, default, doc in describe_fields():
            print(f"{name} = {default}\n    {doc}")
        return 0
    import tomli_w

    cfg = config_from_args(args)
    print(tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True)), end="")
    return 0


def _run_dataset(argv: list[str]) -> int:
    """`rlsys dataset [--env NAME] ARGS`: a built-in environment's dataset writer (`rlsys.envs.<NAME>.dataset`'s
    `main`, ARGS its own; NAME defaults to the default environment)."""
    import importlib

    from rlsys.envs.base import DEFAULT_ENV, ENVIRONMENTS

    name = DEFAULT_ENV
    if argv[:1] == ["--env"] and len(argv) > 1:
        name, argv = argv[1], argv[2:]
    elif argv[:1] and argv[0].startswith("--env="):
        name, argv = argv[0].removeprefix("--env="), argv[1:]
    if name not in ENVIRONMENTS:
        print(f"rlsys dataset: --env {name}: not a built-in environment ({', '.join(ENVIRONMENTS)})", file=sys.stderr)
        return 2
    writer = getattr(importlib.import_module(f"rlsys.envs.{name}.dataset"), "main", None)
    if writer is None:
        print(f"rlsys dataset: the {name} environment has no dataset writer (rlsys/envs/{name}/dataset.py)",
              file=sys.stderr)
        return 2
    return writer(argv) or 0


def _run_tiny_model(argv: list[str]) -> int:
    from rlsys.models import tiny

    return tiny.main(argv) or 0


# subcommands that own their whole argument list (their modules are also `python -m` entry points)
PASSTHROUGH = {"dataset": _run_dataset, "tiny-model": _run_tiny_model}


def _run_eval(argv: list[str]) -> int:
    from jobs import eval as eval_job

    return eval_job.main(argv) or 0


def _run_play(argv: list[str]) -> int:
    from jobs import play

    return play.main(argv) or 0


def _run_check(argv: list[str]) -> int:
    from rlsys import check

    return check.main(argv) or 0


def _run_report(argv: list[str]) -> int:
    from rlsys import report

    return report.main(argv) or 0


def _run_tune(argv: list[str]) -> int:
    from jobs import tune

    return tune.main(argv) or 0


PASSTHROUGH.update({"eval": _run_eval, "play": _run_play, "check": _run_check, "report": _run_report,
                    "tune": _run_tune})


def _run_recipe(argv: list[str]) -> int:
    from jobs import recipe

    return recipe.main(argv) or 0


PASSTHROUGH["recipe"] = _run_recipe


def _run_export(argv: list[str]) -> int:
    from rlsys import lora

    return lora.main(argv) or 0


PASSTHROUGH["export"] = _run_export


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlsys", description="Agentic RL post-training: rollouts through an OpenAI-compatible proxy, GSPO learner."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run a training job (embedded local Ray unless an address is set)")
    add_config_args(p)
    p.set_defaults(handler=_cmd_train)

    p = sub.add_parser("config", help="print the resolved config (or every field with --describe)")
    p.add_argument("--describe", action="store_true", help="list every field, its default and its meaning")
    add_config_args(p)
    p.set_defaults(handler=_cmd_config)

    sub.add_parser("dataset", help="write an environment's dataset (JSONL): `rlsys dataset [--env NAME] --help`")
    sub.add_parser("tiny-model", help="build the small Qwen2-architecture model rlsys uses on CPU")
    sub.add_parser("eval", help="held-out eval of a checkpoint: the environment's rates and error table, --perturb")
    sub.add_parser("play", help="play the default environment's game against a checkpoint in the browser (127.0.0.1)")
    sub.add_parser("check", help="what this machine has (Python, torch, CUDA, vLLM, Ray) and what a job would use")
    sub.add_parser("report", help="summary and PNG plots of a run directory; several: one table, a row each")
    sub.add_parser("tune", help="GPU memory estimate of a config, and settings that fit a --gpu-memory-budget-gib")
    sub.add_parser("export", help="write a LoRA checkpoint as a merged model folder: `rlsys export --merge CKPT OUT`")
    sub.add_parser("recipe", help="run stage configs in sequence (SFT, then GSPO) and summarise; see `rlsys recipe --help`")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UserInputError as err:  # bad config, data, plug-in or checkpoint: one clear message, no traceback
        print(f"rlsys: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
