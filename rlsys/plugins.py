"""Load the user's agent and reward functions (or environment) from `path/to/file.py[:name]` or `package.module:name`.

Refused before any work starts, with the file and what is wrong: a missing file, a syntax error (with
its line), an import that fails inside it, a missing or non-callable function, an agent that is not
`async def`. The default names are `agent` and `reward`.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlsys.errors import UserInputError


class PluginError(UserInputError):
    """The agent or reward spec cannot be loaded; the message says which file and why."""


def _split_spec(spec: str, default_name: str) -> tuple[str, str]:
    target, sep, name = spec.rpartition(":")
    if not sep or "/" in name or name.endswith(".py"):
        return spec, default_name
    return target, name or default_name


def load_function(spec: str, default_name: str, what: str) -> Callable[..., Any]:
    """Import ``spec`` and return its function ``name`` (``default_name`` unless ``:name`` is given)."""
    fn = load_attribute(spec, default_name, what)
    if not callable(fn):
        raise PluginError(f"{what} {spec}: {_split_spec(spec, default_name)[1]!r} is a {type(fn).__name__}, "
                          "not a function")
    return fn


def load_attribute(spec: str, default_name: str, what: str, noun: str = "function") -> Any:
    """Import ``spec`` and return its attribute ``name`` (``default_name`` unless ``:name`` is given), a ``noun``."""
    target, name = _split_spec(spec, default_name)
    if target.endswith(".py") or "/" in target:
        module = _load_file(Path(target), what)
        where = target
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            raise PluginError(f"{what} {spec!r}: no module named {err.name!r} (give a .py path or package.module)") from None
        except SyntaxError as err:
            raise PluginError(f"{what} {spec!r}: syntax error in {err.filename}, line {err.lineno}: {err.msg}") from None
        where = getattr(module, "__file__", target)
    value = getattr(module, name, None)
    if value is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise PluginError(f"{what} {where}: no {noun} {name!r} (callables there: {', '.join(public) or 'none'})")
    return value


def load_agent(spec: str) -> Callable[..., Any]:
    fn = load_function(spec, "agent", "agent")
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(f"agent {spec!r}: must be `async def agent(item, client, model)`, got a plain function")
    _check_arity(fn, 3, f"agent {spec!r}", "(item, client, model)")
    return fn


def load_reward(spec: str) -> tuple[Callable[[dict], Any], Callable[[dict], str] | None]:
    """The reward function and, when the same file defines one, its `outcome(record) -> str` labeller."""
    fn = load_function(spec, "reward", "reward")
    if inspect.iscoroutinefunction(fn):
        raise PluginError(f"reward {spec!r}: must be a plain `def reward(record) -> float`, got async def")
    _check_arity(fn, 1, f"reward {spec!r}", "(record)")
    module = sys.modules.get(fn.__module__)
    outcome = getattr(module, "outcome", None) if module is not None else None
    return fn, outcome if callable(outcome) else None


def _check_arity(fn: Callable[..., Any], n: int, what: str, expected: str) -> None:
    try:
        inspect.signature(fn).bind(*([None] * n))
    except TypeError:
        raise PluginError(f"{what}: signature {inspect.signature(fn)} cannot take {expected}") from None
    except ValueError:
        return  # builtins without a signature: let the call decide


def _load_file(path: Path, what: str):
    if not path.is_file():
        raise PluginError(f"{what} file {path}: not found")
    mod_name = f"rlsys_user_{what}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{what} file {path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[mod_name]
        raise PluginError(f"{what} file {path}: syntax error at line {err.lineno}: {err.msg}") from None
    except Exception as err:  # the user's module raised while importing: say where
        del sys.modules[mod_name]
        tb = traceback.extract_tb(err.__traceback__)[-1]
        raise PluginError(
            f"{what} file {path}: importing it raised {type(err).__name__}: {err} (at {tb.filename}:{tb.lineno})"
        ) from None
    return module
