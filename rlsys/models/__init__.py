"""Models rlsys builds itself (see tiny.py).

The re-exports are lazy (PEP 562) so that `python -m rlsys.models.tiny` does not import the module
twice, and importing this package loads nothing beyond the standard library.
"""
from __future__ import annotations

__all__ = ["build_tiny_model", "ensure_tiny_model"]


def __getattr__(name: str):
    if name in __all__:
        from rlsys.models import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module 'rlsys.models' has no attribute {name!r}")
