"""Built-in model names (`model.ckpt = "rlsys:<name>"`): every name resolves to valid sizes, unknown ones are refused."""
from __future__ import annotations

import pytest

from rlsys.models.resolve import ModelSpecError, resolve_model
from rlsys.models.tiny import DEFAULT_SIZES, NAMED_SIZES, cache_key, resolve_sizes


def test_every_named_size_is_valid_and_has_its_own_cache_folder():
    keys = {name: cache_key(**sizes) for name, sizes in NAMED_SIZES.items()}
    assert NAMED_SIZES["tiny"] == {} and len(set(keys.values())) == len(keys)
    for sizes in NAMED_SIZES.values():
        resolve_sizes(**sizes)  # raises on an unknown size name or heads that do not divide


def test_tiny_h16_is_the_default_shape_in_narrower_heads():
    h16 = resolve_sizes(**NAMED_SIZES["tiny-h16"])
    assert {k: v for k, v in h16.items() if k not in ("num_heads", "num_kv_heads")} == {
        k: v for k, v in resolve_sizes().items() if k not in ("num_heads", "num_kv_heads")}
    assert h16["hidden_size"] // h16["num_heads"] == 8 and DEFAULT_SIZES["hidden_size"] // DEFAULT_SIZES["num_heads"] == 32


def test_unknown_builtin_name_lists_the_known_ones():
    with pytest.raises(ModelSpecError, match=r"'rlsys:tiny-xl': no such built-in model; built-in: rlsys:tiny, rlsys:tiny-h16"):
        resolve_model("rlsys:tiny-xl")
