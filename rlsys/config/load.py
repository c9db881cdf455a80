"""Loading a config: the TOML file, the AReno-style CLI flags and dotted overrides, validation errors that name the
field and its source, the resolved dump (rlsys.config)."""
from __future__ import annotations

import argparse
import datetime as _dt
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from rlsys.config.job import Config
from rlsys.config.sections import ConfigError


# --- CLI flags (AReno-compatible names) ------------------------------------------------------
# flag -> (dotted path, type); bool flags are store_true.
FLAGS: dict[str, tuple[str, type]] = {
    "--algo": ("algo.name", str),
    "--ckpt": ("model.ckpt", str),
    "--dataset-path": ("data.dataset_path", str),
    "--eval-path": ("data.eval_path", str),
    "--env": ("env.name", str),
    "--reward-fn-path": ("env.reward_fn_path", str),
    "--agent-fn": ("env.agent_fn", str),
    "--world-size": ("cluster.world_size", int),
    "--tp-size": ("cluster.tp_size", int),
    "--batch-size": ("rollout.batch_size", int),
    "--n-samples": ("rollout.n_samples", int),
    "--mini-bs": ("learner.mini_bs", int),
    "--max-new-tokens": ("rollout.max_new_tokens", int),
    "--temperature": ("rollout.temperature", float),
    "--lr": ("learner.lr", float),
    "--adam-8bit": ("learner.adam_8bit", bool),
    "--drop-rollout-state": ("rollout.drop_rollout_state", bool),
    "--keep-awake": ("rollout.keep_awake", bool),
    "--save-path": ("checkpoint.save_path", str),
    "--save-interval": ("checkpoint.save_interval", int),
    "--metrics-log-dir": ("logging.metrics_log_dir", str),
    "--max-steps": ("max_steps", int),
    "--seed": ("seed", int),
    "--run-dir": ("run_dir", str),
    "--resume": ("checkpoint.resume", str),
    "--engine": ("rollout.engine", str),
    "--gpu-memory-budget-gib": ("rollout.gpu_memory_budget_gib", float),
    "--address": ("cluster.address", str),
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add `--config`, the AReno-style flags and positional dotted overrides to ``parser``."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML config file (flags and overrides win)")
    for flag, (path, typ) in FLAGS.items():
        dest = "flag:" + flag
        if typ is bool:
            parser.add_argument(flag, dest=dest, action="store_true", default=None, help=f"sets {path}")
        else:
            # parsed as text: pydantic converts and reports bad values with the field path
            parser.add_argument(flag, dest=dest, metavar=typ.__name__.upper(), help=f"sets {path}")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help="dotted overrides, e.g. algo.clip_eps_low=3e-4 learner.lr=1e-6 (values parsed as TOML)",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """Build the config from parsed ``add_config_args`` arguments."""
    flags = {flag: getattr(args, "flag:" + flag) for flag in FLAGS}
    return load_config(
        args.config,
        flags={k: v for k, v in flags.items() if v is not None},
        overrides=list(args.overrides or []),
    )


def load_config(
    path: str | Path | None = None,
    *,
    flags: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """defaults < TOML file < flags (``{"--lr": "1e-5"}``) < dotted overrides (``["algo.name=grpo"]``)."""
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        tree = read_toml(path)
        for key, _ in leaf_items(tree):
            sources[key] = f"file {path}"
    for flag, value in (flags or {}).items():
        if flag not in FLAGS:
            raise ConfigError(f"unknown flag {flag}; known: {', '.join(FLAGS)}")
        dotted = FLAGS[flag][0]
        _set_dotted(tree, dotted, value)
        sources[dotted] = f"flag {flag}={value}"
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. algo.clip_eps_low=3e-4")
        key = key.strip()
        _set_dotted(tree, key, _parse_override_value(raw))
        sources[key] = f"override {item}"
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, sources)) from None
    if not cfg.run_dir:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run_dir = str(Path("runs") / f"{cfg.algo.name}-{stamp}")
    return cfg


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p}: not found")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {p}: invalid TOML: {err}") from None


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as TOML (None values are left out: they mean 'default')."""
    import tomli_w

    data = cfg.model_dump(mode="json", exclude_none=True)
    Path(path).write_text(tomli_w.dumps(data))


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, docstring) of every leaf field, for `--help-config`."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += describe_fields(ann, f"{prefix}{name}.")
        else:
            rows.append((f"{prefix}{name}", repr(field.default), (field.description or "").replace("\n", " ")))
    return rows


# --- helpers ---------------------------------------------------------------------------------
def _parse_override_value(raw: str) -> Any:
    """TOML value syntax (3e-4, true, [1, 2], "text"); anything else is taken as a bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {dotted}")
        node = child
    node[parts[-1]] = value


def leaf_items(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """{"learner": {"lr": 3e-3}} -> [("learner.lr", 3e-3)]: every value of a nested table with its dotted path."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += leaf_items(v, f"{prefix}{k}.")
        else:
            out.append((prefix + k, v))
    return out


def _format_validation_error(err: ValidationError, sources: dict[str, str]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "value_error":
            # our own cross-field checks already start with the field path
            msg = msg.removeprefix("Value error, ")
            field, sep, rest = msg.partition(": ")
            if sep and "." in field:
                loc, msg = field, rest
        source = sources.get(loc)
        got = "" if e["type"] in ("extra_forbidden", "value_error") else f" (got {e.get('input')!r})"
        where = f" [from {source}]" if source else ""
        lines.append(f"{loc or '<root>'}: {msg}{got}{where}")
    return "invalid config:\n  " + "\n  ".join(lines)
