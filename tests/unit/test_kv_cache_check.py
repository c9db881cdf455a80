"""A fixed KV cache (`rollout.kv_cache_gib`) too small for one `rollout.max_model_len` sequence, which vLLM refuses
in its engine's start: refused before Ray (jobs/items.py `check_kv_cache`, rlsys/budget.py `kv_cache_refusal`) and
said by `rlsys tune`, with the numbers and the fix; not on the transformers engine, which ignores the setting."""
from __future__ import annotations

import pytest

from rlsys.budget import kv_cache_refusal, one_sequence_kv_bytes
from rlsys.memory import GIB, JobShape, ModelShape
from tests.conftest import QWEN15B

# 2 (K, V) x 28 layers x 2 KV heads x 128 head_dim x 2 bytes = 28,672 bytes a token; 2048 tokens are 128 blocks of
# 16, plus vLLM's null block: 129 x 16 x 28,672 bytes
ONE_SEQUENCE_2048 = 129 * 16 * 28_672


def _cfg(folder, tmp_path, *overrides, engine="vllm", **flags):
    from rlsys.config import load_config

    return load_config(flags={"--ckpt": str(folder), "--engine": engine, "--run-dir": str(tmp_path / "run"), **flags},
                       overrides=["rollout.max_model_len=2048", *overrides])


def test_one_sequence_by_hand():
    shape = ModelShape.from_config(QWEN15B)
    assert shape.kv_bytes_per_token() == 28_672
    assert one_sequence_kv_bytes(shape, 2048) == ONE_SEQUENCE_2048
    assert one_sequence_kv_bytes(shape, 2049) == ONE_SEQUENCE_2048 + 16 * 28_672  # a block more
    # tensor parallel: each GPU holds its share of the KV heads (1 of 2 on 2 GPUs; 1 still on 4)
    assert shape.kv_bytes_per_token(tp_size=2) == shape.kv_bytes_per_token(tp_size=4) == 28_672 // 2
    full = JobShape(max_model_len=2048, kv_cache_bytes=ONE_SEQUENCE_2048)
    assert kv_cache_refusal(shape, full) is None  # exactly enough
    assert kv_cache_refusal(shape, JobShape(max_model_len=2048, kv_cache_bytes=ONE_SEQUENCE_2048 - 1)) is not None
    assert kv_cache_refusal(shape, JobShape(max_model_len=2048)) is None  # unset: vLLM sizes it
    sliding = ModelShape.from_config({**QWEN15B, "use_sliding_window": True})  # needs less than counted: not judged
    assert kv_cache_refusal(sliding, JobShape(max_model_len=2048, kv_cache_bytes=1)) is None


def test_a_tiny_kv_cache_is_refused_before_ray_with_the_numbers_and_the_fix(qwen15b_folder, tmp_path):
    from jobs.items import check_kv_cache
    from rlsys.config import ConfigError

    with pytest.raises(ConfigError) as err:
        check_kv_cache(_cfg(qwen15b_folder, tmp_path, "rollout.kv_cache_gib=0.01"))  # no budget
    text = str(err.value)
    assert "rollout.kv_cache_gib: 0.01 GiB of KV cache" in text  # the size given
    assert "rollout.max_model_len 2048 tokens needs with this model: 0.0551 GiB" in text  # 59,179,008 bytes
    assert "28,672 bytes a token, 37,449 tokens per GiB" in text
    # the fix: 0.06 GiB holds the 2048 tokens; 0.01 GiB (10,737,418 bytes) holds 23 blocks of 16 x 28,672 bytes,
    # one of them the null block: 22 x 16 = 352 tokens
    assert "Raise rollout.kv_cache_gib to at least 0.06 or lower rollout.max_model_len to at most 352" in text
    # and both fixes pass, one step short of them does not
    check_kv_cache(_cfg(qwen15b_folder, tmp_path, "rollout.kv_cache_gib=0.06"))
    check_kv_cache(_cfg(qwen15b_folder, tmp_path, "rollout.kv_cache_gib=0.01", "rollout.max_model_len=352"))
    for short in (["rollout.kv_cache_gib=0.05"], ["rollout.kv_cache_gib=0.01", "rollout.max_model_len=353"]):
        with pytest.raises(ConfigError, match="vLLM would refuse to start"):
            check_kv_cache(_cfg(qwen15b_folder, tmp_path, *short))
    # with a budget too: the same refusal
    with pytest.raises(ConfigError, match="at least 0.06"):
        check_kv_cache(_cfg(qwen15b_folder, tmp_path, "rollout.kv_cache_gib=0.01",
                            **{"--gpu-memory-budget-gib": "24"}))


def test_exactly_one_sequence_is_accepted(qwen15b_folder, tmp_path):
    from jobs.items import check_kv_cache
    from rlsys.config import ConfigError

    exact = ONE_SEQUENCE_2048 / GIB  # a power of two apart: the float is exact, and so is int(gib * GIB)
    check_kv_cache(_cfg(qwen15b_folder, tmp_path, f"rollout.kv_cache_gib={exact!r}"))
    with pytest.raises(ConfigError):
        check_kv_cache(_cfg(qwen15b_folder, tmp_path, f"rollout.kv_cache_gib={(ONE_SEQUENCE_2048 - 1) / GIB!r}"))


def test_the_transformers_engine_ignores_kv_cache_gib_and_auto_follows_the_machine(qwen15b_folder, tmp_path,
                                                                                   monkeypatch):
    import importlib.util

    import rlsys.memory as memory
    from jobs.items import check_kv_cache
    from rlsys.config import ConfigError

    check_kv_cache(_cfg(qwen15b_folder, tmp_path, "rollout.kv_cache_gib=0.01", engine="transformers"))
    # auto: vLLM where it is installed and a GPU is seen here (the rollout actor's rule), else transformers
    real_find_spec = importlib.util.find_spec

    def machine(vllm: bool, gpu: bool) -> None:
        monkeypatch.setattr(memory, "device_total_bytes_nvml", lambda: 80 * GIB if gpu else None)
        installed = object() if vllm else None
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: installed if name == "vllm" else real_find_spec(name, *a))

    for vllm, gpu in ((False, True), (True, False)):
        machine(vllm, gpu)
        check_kv_cache(_cfg(qwen15b_folder, tmp_path, "rollout.kv_cache_gib=0.01", engine="auto"))
    machine(True, True)
    with pytest.raises(ConfigError, match="at least 0.06"):
        check_kv_cache(_cfg(qwen15b_folder, tmp_path, "rollout.kv_cache_gib=0.01", engine="auto"))


def test_train_exits_2_before_ray_and_the_run_directory(qwen15b_folder, tmp_path, capsys):
    from jobs.train import main

    rc = main(["--ckpt", str(qwen15b_folder), "--engine", "vllm", "--run-dir", str(tmp_path / "run"),
               "rollout.max_model_len=2048", "rollout.kv_cache_gib=0.01"])
    assert rc == 2
    assert "or lower rollout.max_model_len to at most 352" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_tune_says_it_and_gives_no_command_train_would_refuse(qwen15b_folder, capsys):
    from jobs.tune import main

    args = ["--ckpt", str(qwen15b_folder), "--gpu-memory-budget-gib", "24", "--prompt-tokens", "240",
            "rollout.max_model_len=2048", "rollout.kv_cache_gib=0.01"]
    assert main(args) == 2
    out = capsys.readouterr().out
    assert "-> and rlsys train refuses it: rollout.kv_cache_gib: 0.01 GiB" in out and "at most 352" in out
    assert "use: rlsys train" not in out and "no command to use" in out
    assert main([*args, "--engine", "transformers"]) == 0  # the transformers engine ignores kv_cache_gib
    out = capsys.readouterr().out
    assert "refuses it" not in out and "use: rlsys train" in out
    assert main([*args[:-1], "rollout.kv_cache_gib=0.06"]) == 0
    assert "refuses it" not in capsys.readouterr().out
