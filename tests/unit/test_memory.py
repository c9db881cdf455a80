"""The GPU memory estimate (rlsys/memory.py) against hand-computed numbers, the budget check before Ray, and
`rlsys tune` (jobs/tune.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlsys.memory import (GIB, LOGPROB_CHUNK_BYTES, CONTEXT_BYTES, JobShape, MemoryBudgetError, ModelShape,
                          estimate, suggest)

QWEN05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "model_type": "qwen2"}
QWEN15B = {**QWEN05B, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "intermediate_size": 8960}


def test_parameter_counts_match_the_published_qwen2_5_models():
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings; q/k/v biases)
    assert ModelShape.from_config(QWEN05B).num_params() == 494_032_768
    # Qwen2.5-1.5B: 1,543,714,304
    assert ModelShape.from_config(QWEN15B).num_params() == 1_543_714_304
    untied = ModelShape.from_config({**QWEN05B, "tie_word_embeddings": False})
    assert untied.num_params() - 494_032_768 == 151936 * 896  # a separate lm_head


def test_llama_style_config_without_biases_and_nested_text_config():
    llama = {"text_config": {**QWEN05B, "model_type": "llama", "attention_bias": False}}
    shape = ModelShape.from_config(llama)
    # the biases of q (896), k (128) and v (128) in each of 24 layers are gone
    assert shape.num_params() == 494_032_768 - 24 * (896 + 128 + 128)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_config({"vocab_size": 10})


def test_kv_cache_bytes_per_token_by_hand():
    # 1.5B: 2 (K, V) x 28 layers x 2 KV heads x 128 head_dim x 2 bytes = 28,672 bytes
    assert ModelShape.from_config(QWEN15B).kv_bytes_per_token(2) == 28_672


def test_learner_and_engine_components_by_hand():
    shape = ModelShape.from_config(QWEN15B)
    p = 1_543_714_304
    job = JobShape(dtype_bytes=2, adam_8bit=True, gradient_checkpointing=True, mini_bs=2, seq_len=512,
                   max_model_len=512, engine_max_batch=64, concurrency=16, enforce_eager=True)
    est = estimate(shape, job, budget_gib=24)
    assert est.learner["weights"] == est.learner["gradients"] == est.learner["weight-push buffers"] == 2 * p
    assert est.learner["optimizer states"] == 2 * p  # 8-bit Adam: two 1-byte states per parameter
    tokens = 2 * 512
    assert est.learner["logits"] == tokens * 151936 * 14 + 2 * LOGPROB_CHUNK_BYTES
    per_layer = 2 * (18 * 1536 + 3 * 256 + 4 * 8960)
    assert est.learner["activations"] == tokens * (28 * 2 * 1536 + per_layer) + tokens * 10 * 1536
    assert est.engine["weights"] == 2 * p
    assert est.engine["KV cache"] == 16 * 512 * 28_672  # 16 sequences in flight x 512 tokens
    assert est.engine["CUDA graphs"] == 0 and est.engine["CUDA context"] == CONTEXT_BYTES
    assert 14 * GIB < est.learner_bytes < 16 * GIB and 4 * GIB < est.engine_bytes < 5.5 * GIB
    assert est.fits
    # torch AdamW on bf16 parameters keeps two bf16 states: 4 bytes/param; on float32, 8 bytes/param
    assert estimate(shape, JobShape(adam_8bit=False)).learner["optimizer states"] == 4 * p
    assert estimate(shape, JobShape(adam_8bit=False, dtype_bytes=4)).learner["optimizer states"] == 8 * p
    # fp32 master weights (learner.fp32_master): float32 weights and gradients, bf16 push buffers
    masters = estimate(shape, JobShape(adam_8bit=True, param_bytes=4)).learner
    assert masters["weights"] == masters["gradients"] == 4 * p and masters["weight-push buffers"] == 2 * p
    assert masters["optimizer states"] == 2 * p


def test_kl_reference_and_entropy_bonus_are_counted(tmp_path):
    from rlsys.config import load_config

    shape = ModelShape.from_config(QWEN15B)
    p, tokens = 1_543_714_304, 2 * 512
    base = JobShape(dtype_bytes=2, param_bytes=4, mini_bs=2, seq_len=512)
    plain = estimate(shape, base)
    assert "reference model" not in plain.learner  # kl_coef = 0: nothing loaded, nothing counted
    ref = estimate(shape, JobShape(**{**base.__dict__, "reference_model": True}))
    assert ref.learner["reference model"] == 2 * p  # frozen, in the compute dtype (not the fp32 masters)
    assert ref.learner_bytes - plain.learner_bytes == 2 * p
    bonus = estimate(shape, JobShape(**{**base.__dict__, "entropy_bonus": True}))
    assert bonus.learner["logits"] - plain.learner["logits"] == tokens * 151936 * 4
    cfg = load_config(flags={"--run-dir": str(tmp_path / "r")}, overrides=["algo.kl_coef=0.05", "algo.entropy_coef=0.001"])
    assert (JobShape.from_config(cfg).reference_model, JobShape.from_config(cfg).entropy_bonus) == (True, True)
    off = load_config(flags={"--run-dir": str(tmp_path / "r")})
    assert (JobShape.from_config(off).reference_model, JobShape.from_config(off).entropy_bonus) == (False, False)


def test_checkpointing_and_smaller_micro_batches_need_less():
    shape = ModelShape.from_config(QWEN15B)
    base = JobShape(mini_bs=8, seq_len=1024, max_model_len=1024)
    full = estimate(shape, base).learner["activations"]
    ckpt = estimate(shape, JobShape(mini_bs=8, seq_len=1024, max_model_len=1024, gradient_checkpointing=True))
    assert ckpt.learner["activations"] < full / 10
    assert estimate(shape, JobShape(mini_bs=2, seq_len=1024)).learner["logits"] < estimate(shape, base).learner["logits"]


def test_split_gives_the_engine_the_rest_and_fractions_follow_the_device():
    shape = ModelShape.from_config(QWEN15B)
    est = estimate(shape, JobShape(adam_8bit=True, gradient_checkpointing=True, mini_bs=2, seq_len=512,
                                   max_model_len=512, enforce_eager=True), budget_gib=24)
    split = est.split()
    assert split.learner_bytes + split.engine_bytes == 24 * GIB
    assert split.learner_bytes >= est.learner_bytes and split.engine_bytes >= est.engine_bytes
    device = 140 * GIB
    assert split.learner_fraction(device) == pytest.approx((split.learner_bytes - CONTEXT_BYTES) / device)
    assert split.engine_fraction(device) == pytest.approx((split.engine_bytes - CONTEXT_BYTES) / device)
    with pytest.raises(MemoryBudgetError, match="of this GPU"):
        split.learner_fraction(8 * GIB)


def test_over_budget_is_refused_with_the_table_and_a_fix():
    shape = ModelShape.from_config(QWEN15B)
    est = estimate(shape, JobShape(mini_bs=8, seq_len=1024, max_model_len=1024), budget_gib=24)
    assert not est.fits
    with pytest.raises(MemoryBudgetError) as err:
        est.split()
    text = str(err.value)
    assert "over its 24.0 GiB budget" in text and "logits" in text and "KV cache" in text
    assert "fits (" in text and "learner.mini_bs=" in text


def test_suggest_fits_with_margin_or_says_none():
    shape = ModelShape.from_config(QWEN15B)
    job = JobShape(mini_bs=8, seq_len=1024, max_model_len=1024, concurrency=64, engine_max_batch=64)
    prop = suggest(shape, job, 24, per_minibatch=64, max_concurrency=64)
    assert prop is not None and prop.estimate.total_bytes <= 0.9 * 24 * GIB
    assert prop.changed and all(k.split(".")[0] in ("learner", "model", "rollout") for k in prop.changed)
    assert suggest(shape, job, 6) is None  # the weights alone (learner + engine copies) are ~14 GiB


def test_module_imports_without_torch_or_ray():
    code = "import sys, rlsys.memory; print(json.dumps(sorted(m for m in ('torch', 'ray') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# ------------------------------------------------------------------ the check before Ray, and rlsys tune
@pytest.fixture
def qwen15b_folder(tmp_path):
    folder = tmp_path / "q15"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN15B))
    return folder


def test_job_shape_follows_the_config(tmp_path):
    from rlsys.config import load_config

    cfg = load_config(flags={"--batch-size": "8", "--n-samples": "4", "--mini-bs": "2", "--max-new-tokens": "64",
                             "--adam-8bit": True, "--run-dir": str(tmp_path / "r")},
                      overrides=["rollout.max_model_len=1024", "model.gradient_checkpointing=true",
                                 "learner.fp32_master=true", "rollout.enforce_eager=true"])
    job = JobShape.from_config(cfg)
    assert (job.dtype_bytes, job.param_bytes, job.adam_8bit, job.gradient_checkpointing) == (2, 4, True, True)
    assert (job.mini_bs, job.seq_len, job.max_model_len, job.concurrency, job.enforce_eager) == (2, 1024, 1024, 32, True)
    assert JobShape.from_config(cfg, prompt_tokens=200).seq_len == 264  # prompt + max_new_tokens


def test_preflight_refuses_an_over_budget_job_with_config_error(qwen15b_folder, tmp_path):
    from jobs.items import check_memory_budget
    from rlsys.config import ConfigError, load_config

    cfg = load_config(flags={"--ckpt": str(qwen15b_folder), "--gpu-memory-budget-gib": "24", "--mini-bs": "8",
                             "--batch-size": "8", "--n-samples": "8", "--run-dir": str(tmp_path / "run")},
                      overrides=["rollout.max_model_len=1024"])
    with pytest.raises(ConfigError, match="over its 24.0 GiB budget"):
        check_memory_budget(cfg)
    ok = load_config(flags={"--ckpt": str(qwen15b_folder), "--gpu-memory-budget-gib": "24", "--mini-bs": "2",
                            "--adam-8bit": True, "--run-dir": str(tmp_path / "run")},
                     overrides=["rollout.max_model_len=512", "model.gradient_checkpointing=true"])
    check_memory_budget(ok)  # fits: no exception


def test_train_exits_2_before_ray_when_over_budget(qwen15b_folder, tmp_path, capsys):
    from jobs.train import main

    rc = main(["--ckpt", str(qwen15b_folder), "--gpu-memory-budget-gib", "8", "--run-dir", str(tmp_path / "run")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "rollout.gpu_memory_budget_gib" in err and "GiB" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory (and Ray)


def test_tune_proposes_flags_that_fit(qwen15b_folder, capsys):
    from jobs.tune import main

    rc = main(["--ckpt", str(qwen15b_folder), "--gpu-memory-budget-gib", "24", "--batch-size", "8", "--n-samples", "8",
               "--mini-bs", "8", "--prompt-tokens", "240", "rollout.max_model_len=1024"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "does NOT fit" in out and "proposed:" in out
    use = [line for line in out.splitlines() if line.startswith("use: rlsys train")]
    assert use and "--gpu-memory-budget-gib 24" in use[0] and "learner.mini_bs=" in use[0]
    # the proposal is a valid config and passes the check
    from rlsys.config import load_config
    from rlsys.memory import job_estimate

    overrides = [t for t in use[0].split() if "=" in t]
    cfg = load_config(flags={"--ckpt": str(qwen15b_folder), "--gpu-memory-budget-gib": "24", "--batch-size": "8",
                             "--n-samples": "8", "--mini-bs": "8"}, overrides=["rollout.max_model_len=1024", *overrides])
    assert job_estimate(cfg, qwen15b_folder, prompt_tokens=240).fits


def test_tune_exits_2_when_nothing_fits_or_no_budget(qwen15b_folder, capsys):
    from jobs.tune import main

    assert main(["--ckpt", str(qwen15b_folder), "--gpu-memory-budget-gib", "6", "--prompt-tokens", "200"]) == 2
    assert "nothing fits 6 GiB" in capsys.readouterr().out
    assert main(["--ckpt", str(qwen15b_folder)]) == 2
    assert "needs a budget" in capsys.readouterr().err


# ------------------------------------------------------------------ the GPU-only branches, with torch.cuda faked
def test_learner_caps_its_allocator_at_its_share(monkeypatch, qwen15b_folder, tmp_path):
    import torch

    from actors.learner import MemoryProbe, apply_memory_budget
    from rlsys.config import load_config
    from rlsys.memory import budget_split

    cfg = load_config(flags={"--ckpt": str(qwen15b_folder), "--gpu-memory-budget-gib": "24", "--mini-bs": "2",
                             "--adam-8bit": True, "--run-dir": str(tmp_path / "run")},
                      overrides=["rollout.max_model_len=512", "model.gradient_checkpointing=true"])
    calls = {}

    class Props:
        total_memory = 140 * GIB

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index: calls.update(f=f, index=index))
    split = budget_split(cfg, qwen15b_folder)
    fraction = apply_memory_budget(split, 24.0, torch.device("cuda"))
    assert calls == {"f": fraction, "index": 0}
    assert fraction == pytest.approx((split.learner_bytes - CONTEXT_BYTES) / (140 * GIB))
    assert apply_memory_budget(split, 24.0, torch.device("cpu")) is None

    # the engine gets the rest of the budget (actors/rollout.py)
    import rlsys.engines.vllm_engine as vllm_engine
    from actors.rollout import engine_memory_fraction
    from jobs.placement import engine_settings

    monkeypatch.setattr(vllm_engine, "device_total_bytes", lambda: 140 * GIB)
    assert engine_memory_fraction(engine_settings(cfg, str(qwen15b_folder))) == pytest.approx(
        (split.engine_bytes - CONTEXT_BYTES) / (140 * GIB))
    cfg.rollout.gpu_memory_budget_gib = None
    assert engine_memory_fraction(engine_settings(cfg, str(qwen15b_folder))) == pytest.approx(1 / 3)
    # a fixed KV cache and no budget: what the engine holds (weights, activations, that cache), not a third
    cfg.rollout.kv_cache_gib = 3.0
    from rlsys.memory import job_estimate

    engine = job_estimate(cfg, qwen15b_folder).engine
    held = engine["weights"] + engine["activations"] + engine["CUDA graphs"] + 3 * GIB
    assert engine_memory_fraction(engine_settings(cfg, str(qwen15b_folder))) == pytest.approx(held / (140 * GIB))
    assert held < 140 * GIB / 3
    cfg.rollout.kv_cache_gib = None

    # the train-phase probe: device use at the peak = use at the start - reserved then + peak reserved
    import rlsys.memory as memory

    monkeypatch.setattr(memory, "device_used_bytes_nvml", lambda: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda index: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 4 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda index: 7 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 3 * GIB)
    got = MemoryProbe(torch.device("cuda")).finish()
    assert got == {"mem/learner_peak_allocated_gib": 6.0, "mem/learner_peak_reserved_gib": 7.0,
                   "mem/learner_resident_gib": 3.0, "mem/train_device_used_gib": 13.0}
    assert MemoryProbe(torch.device("cpu")).finish() == {}


def test_keep_awake_auto_stays_awake_only_where_vllm_and_the_learner_fit_side_by_side(qwen15b_folder, tmp_path):
    from jobs.engine_group import choose_sleep_level
    from rlsys.config import load_config

    def cfg(*overrides, **flags):
        return load_config(flags={"--ckpt": str(qwen15b_folder), "--run-dir": str(tmp_path / "r"), **flags},
                           overrides=list(overrides))

    from rlsys.memory import CONTEXT_BYTES

    # what a rollout actor reports: the device and vLLM's default third of it plus its CUDA context
    gpu = lambda gib: [{"on_gpu": True, "device_bytes": int(gib * GIB),  # noqa: E731
                        "engine_bytes": int(gib * GIB / 3) + CONTEXT_BYTES}]
    level, why = choose_sleep_level(cfg(), str(qwen15b_folder), gpu(140))
    assert level == 0 and "within 90% of 140.0 GiB" in why
    level, why = choose_sleep_level(cfg(), str(qwen15b_folder), gpu(24))  # vLLM's 8 GiB third + a 1.5B learner
    assert level == 1 and "over 90%" in why
    level, why = choose_sleep_level(cfg(**{"--gpu-memory-budget-gib": "80"}), str(qwen15b_folder), gpu(96))
    assert level == 0 and "budget caps vLLM and the learner" in why
    assert choose_sleep_level(cfg(), str(qwen15b_folder), [{"on_gpu": False, "device_bytes": None}]) == (
        1, "keep_awake auto: engines not on a GPU")
    assert choose_sleep_level(cfg(**{"--drop-rollout-state": True}), str(qwen15b_folder), gpu(140))[0] == 2
    assert choose_sleep_level(cfg("rollout.keep_awake=false"), str(qwen15b_folder), gpu(140))[0] == 1
    level, why = choose_sleep_level(cfg(**{"--keep-awake": True}), str(qwen15b_folder), gpu(24))
    assert level == 0 and "WARNING" in why and "over 90%" in why  # awake as asked, but told it may not fit
    level, why = choose_sleep_level(cfg("rollout.overlap=true"), str(qwen15b_folder), gpu(24))
    assert level == 0 and why.startswith("rollout.overlap") and "WARNING" in why  # it samples meanwhile
    level, why = choose_sleep_level(cfg("rollout.overlap=true"), str(qwen15b_folder), gpu(140))
    assert level == 0 and "WARNING" not in why
