"""Environments: the `Environment` interface (base.py) and the built-in environments, one package each.

`from rlsys.envs import Environment` is what a user's environment file needs (docs/CONTRACTS.md, "Environments").
"""
from rlsys.envs.base import DEFAULT_ENV, ENVIRONMENTS, Environment, Headline, load_environment, resolve_environment

__all__ = ["DEFAULT_ENV", "ENVIRONMENTS", "Environment", "Headline", "load_environment", "resolve_environment"]
