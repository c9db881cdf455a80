"""The engines' shared request check (rlsys/engines/base.py `checked_prompt`): what both engines refuse alike."""
from __future__ import annotations

import pytest

from rlsys.engines.base import checked_prompt


def test_a_prompt_in_the_vocabulary_with_room_to_answer_comes_back_as_ints():
    assert checked_prompt([1, 2.0, 3], vocab_size=10, max_new_tokens=4, max_model_len=7, limit="x") == [1, 2, 3]
    assert checked_prompt([1], vocab_size=10, max_new_tokens=10**6, max_model_len=None, limit="x") == [1]


@pytest.mark.parametrize("ids, max_len, error", [
    ([1, 10], 100, r"prompt_ids: ids \[10\] outside the vocabulary \[0, 10\)"),
    ([], 100, "prompt_ids is empty"),
    ([1, 2, 3], 6, r"prompt \(3 tokens\) \+ max_new_tokens \(4\) = 7 exceeds the engine's max_model_len \(6\)"),
])
def test_a_bad_prompt_is_refused_with_its_reason(ids, max_len, error):
    with pytest.raises(ValueError, match=error):
        checked_prompt(ids, vocab_size=10, max_new_tokens=4, max_model_len=max_len, limit="the engine's max_model_len")
