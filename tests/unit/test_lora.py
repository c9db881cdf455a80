"""LoRA (rlsys/lora.py, `learner.lora`): config checks, the engine-side merge (transformers and vLLM layouts), the
learner's trainable set and push, adapter checkpoints, `rlsys export --merge`, the memory estimate."""
from __future__ import annotations

import json

import pytest
import torch

from rlsys.config import ConfigError, load_config
from rlsys.lora import LoraMerge, LoraSlots, VllmSlots, VllmTargets, slot_rank, split_adapter_name

LORA = ["learner.lora.enabled=true", "learner.lora.rank=4", "learner.lora.alpha=8"]


# --------------------------------------------------------------------------------------------- config
def test_lora_is_off_by_default_and_its_scale_is_alpha_over_rank():
    cfg = load_config()
    assert cfg.learner.lora.enabled is False
    cfg = load_config(overrides=LORA)
    assert cfg.learner.lora.scale() == 2.0


@pytest.mark.parametrize("override, message", [
    ("learner.lora.target_modules=[]", "learner.lora.target_modules: empty"),
    ('learner.lora.target_modules=["q_proj", "q_proj"]', "named twice"),
    ('learner.lora.target_modules=["model.q proj"]', "identifiers"),
    ("learner.lora.rank=0", "learner.lora.rank"),
    ("learner.lora.dropout=1.0", "learner.lora.dropout"),
    ("rollout.drop_rollout_state=true", "drops the engine's base weights"),
    ("learner.fp32_master=true", "learner.fp32_master"),
])
def test_bad_lora_settings_are_refused_with_the_field_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(overrides=[*LORA, override])


def test_base_4bit_needs_lora_on():
    with pytest.raises(ConfigError, match="learner.lora.base_4bit"):
        load_config(overrides=["learner.lora.base_4bit=true"])


# ------------------------------------------------------------------------------------ engine-side merge
def test_adapter_names_split_into_module_and_part_and_other_names_are_refused():
    assert split_adapter_name("model.layers.0.mlp.up_proj.lora_B") == ("model.layers.0.mlp.up_proj", "lora_B")
    with pytest.raises(ValueError, match="not an adapter tensor"):
        split_adapter_name("model.layers.0.mlp.up_proj.weight")


def _dict_resolver(weights: dict[str, torch.Tensor]):
    return lambda module: (weights[f"{module}.weight"], weights[f"{module}.weight"])


def test_merge_writes_base_plus_scaled_product_and_recomputes_from_the_kept_base():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    base = w.clone()
    merge = LoraMerge(0.5, _dict_resolver({"l.weight": w}))
    a1, b1 = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    assert merge.apply([("l.lora_A", a1), ("l.lora_B", b1)]) == 2
    torch.testing.assert_close(w, base + 0.5 * b1 @ a1)
    a2, b2 = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    merge.apply([("l.lora_B", b2), ("l.lora_A", a2)])
    torch.testing.assert_close(w, base + 0.5 * b2 @ a2)  # from the base, not on top of the first merge
    merge.apply([("l.lora_A", a2), ("l.lora_B", torch.zeros(6, 2))])
    assert torch.equal(w, base), "a zero adapter must give the base back exactly"
    assert merge.kept_bytes() == base.numel() * 4


def test_merge_refuses_a_half_adapter_a_wrong_shape_and_an_unknown_layer():
    merge = LoraMerge(1.0, _dict_resolver({"l.weight": torch.zeros(4, 3)}))
    with pytest.raises(ValueError, match="lora_A and lora_B travel together"):
        merge.apply([("l.lora_A", torch.zeros(2, 3))])
    with pytest.raises(ValueError, match="do not make the engine's"):
        merge.apply([("l.lora_A", torch.zeros(2, 3)), ("l.lora_B", torch.zeros(5, 2))])
    with pytest.raises(KeyError):
        merge.apply([("m.lora_A", torch.zeros(2, 3)), ("m.lora_B", torch.zeros(4, 2))])


class _Fused(torch.nn.Module):
    def __init__(self, sizes: list[int], cols: int) -> None:
        super().__init__()
        self.output_sizes = sizes  # as vLLM's QKVParallelLinear / MergedColumnParallelLinear list them
        self.weight = torch.nn.Parameter(torch.randn(sum(sizes), cols), requires_grad=False)


class _VllmLike(torch.nn.Module):
    """The parameter layout of a one-block vLLM Qwen2: q/k/v fused into qkv_proj, gate/up into gate_up_proj."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = _Fused([8, 2, 2], 8)
        self.attn.o_proj = torch.nn.Linear(8, 8, bias=False).requires_grad_(False)
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = _Fused([6, 6], 8)


def test_vllm_merge_puts_each_shard_delta_into_its_rows_of_the_fused_weight():
    torch.manual_seed(0)
    model = _VllmLike()
    qkv0, gate_up0, o0 = (model.attn.qkv_proj.weight.clone(), model.mlp.gate_up_proj.weight.clone(),
                          model.attn.o_proj.weight.clone())
    merge = LoraMerge(2.0, VllmTargets(model).resolve)
    a_v, b_v = torch.randn(3, 8), torch.randn(2, 3)
    a_up, b_up = torch.randn(3, 8), torch.randn(6, 3)
    a_o, b_o = torch.randn(3, 8), torch.randn(8, 3)
    merge.apply([("attn.v_proj.lora_A", a_v), ("attn.v_proj.lora_B", b_v), ("mlp.up_proj.lora_A", a_up),
                 ("mlp.up_proj.lora_B", b_up), ("attn.o_proj.lora_A", a_o), ("attn.o_proj.lora_B", b_o)])
    qkv, gate_up = model.attn.qkv_proj.weight, model.mlp.gate_up_proj.weight
    assert torch.equal(qkv[:10], qkv0[:10]), "q and k rows must stay the base's"
    torch.testing.assert_close(qkv[10:12], qkv0[10:12] + 2.0 * b_v @ a_v)
    assert torch.equal(gate_up[:6], gate_up0[:6])
    torch.testing.assert_close(gate_up[6:], gate_up0[6:] + 2.0 * b_up @ a_up)
    torch.testing.assert_close(model.attn.o_proj.weight, o0 + 2.0 * b_o @ a_o)


def test_vllm_merge_refuses_a_fused_layer_whose_shards_do_not_fill_it():
    model = _VllmLike()
    model.attn.qkv_proj.output_sizes = [4, 1, 1]  # a tensor-parallel shard: half the rows
    with pytest.raises(NotImplementedError, match="tensor parallel"):
        LoraMerge(1.0, VllmTargets(model).resolve).apply(
            [("attn.q_proj.lora_A", torch.zeros(2, 8)), ("attn.q_proj.lora_B", torch.zeros(8, 2))])


# ------------------------------------------------------------------------ engine-side slots (serve = adapter)
class _LoraLayer:
    """vLLM's LoRA layer buffers (vllm/lora/layers/base_linear.py `create_lora_weights`): per slice s,
    `lora_a_stacked[s]` (slots, 1, max rank, in) and `lora_b_stacked[s]` (slots, 1, out_s, max rank), zeros."""

    def __init__(self, outs: list[int], cols: int, max_rank: int = 4, slots: int = 2) -> None:
        self.lora_a_stacked = tuple(torch.zeros(slots, 1, max_rank, cols) for _ in outs)
        self.lora_b_stacked = tuple(torch.zeros(slots, 1, out, max_rank) for out in outs)

    def delta(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """What vLLM's LoRA kernels add to the base layer's output for a token of slot ``slot``: x A^T B^T per
        slice, the slices' outputs side by side (B already holds the scale)."""
        return torch.cat([x @ a[slot, 0].T @ b[slot, 0].T for a, b in zip(self.lora_a_stacked, self.lora_b_stacked)],
                         dim=-1)


def _vllm_lora_layers() -> dict[str, _LoraLayer]:
    return {"attn.qkv_proj": _LoraLayer([8, 2, 2], 8), "attn.o_proj": _LoraLayer([8], 8),
            "mlp.gate_up_proj": _LoraLayer([6, 6], 8)}


def test_slots_serve_what_the_merge_would_write_and_leave_other_slices_and_slots_zero():
    """The adapter written into the slot (A, scale x B; vLLM applies B A unscaled) adds to a layer's output exactly
    the merge's scale B A: the layouts agree slice by slice, and what the push does not name stays zero."""
    torch.manual_seed(0)
    layers = _vllm_lora_layers()
    slots = VllmSlots(layers, _VllmLike.packed_modules_mapping, slot=1)
    lora = LoraSlots(2.0, slots.resolve, slots.signature)
    a_v, b_v = torch.randn(3, 8), torch.randn(2, 3)  # rank 3 in slots of max rank 4
    a_up, b_up = torch.randn(3, 8), torch.randn(6, 3)
    a_o, b_o = torch.randn(3, 8), torch.randn(8, 3)
    named = [("attn.v_proj.lora_A", a_v), ("attn.v_proj.lora_B", b_v), ("mlp.up_proj.lora_A", a_up),
             ("mlp.up_proj.lora_B", b_up), ("attn.o_proj.lora_A", a_o), ("attn.o_proj.lora_B", b_o)]
    assert lora.apply(named) == 6 and lora.kept_bytes() == 0
    x = torch.randn(5, 8)
    qkv = layers["attn.qkv_proj"].delta(x, 1)
    assert torch.equal(qkv[:, :10], torch.zeros(5, 10)), "q and k slices must stay zero"
    torch.testing.assert_close(qkv[:, 10:], x @ (2.0 * b_v @ a_v).T)
    gate_up = layers["mlp.gate_up_proj"].delta(x, 1)
    assert torch.equal(gate_up[:, :6], torch.zeros(5, 6))
    torch.testing.assert_close(gate_up[:, 6:], x @ (2.0 * b_up @ a_up).T)
    torch.testing.assert_close(layers["attn.o_proj"].delta(x, 1), x @ (2.0 * b_o @ a_o).T)
    for layer in layers.values():  # slot 0 (another adapter's) untouched
        assert not any(t[0].any() for t in (*layer.lora_a_stacked, *layer.lora_b_stacked))
        assert not any(a[1, 0, 3:].any() for a in layer.lora_a_stacked), "rows past the rank must stay zero"
    a2, b2 = torch.randn(3, 8), torch.randn(8, 3)
    lora.apply([("attn.o_proj.lora_A", a2), ("attn.o_proj.lora_B", b2)])  # a new push replaces, never adds
    torch.testing.assert_close(layers["attn.o_proj"].delta(x, 1), x @ (2.0 * b2 @ a2).T)


def test_slots_refuse_a_half_adapter_a_rank_over_the_slot_a_wrong_shape_and_an_unknown_layer():
    slots = VllmSlots(_vllm_lora_layers(), _VllmLike.packed_modules_mapping, slot=0)
    lora = LoraSlots(1.0, slots.resolve, slots.signature)
    with pytest.raises(ValueError, match="lora_A and lora_B travel together"):
        lora.apply([("attn.o_proj.lora_A", torch.zeros(2, 8))])
    with pytest.raises(ValueError, match="do not fit the engine's adapter slot"):  # rank 5 > max rank 4
        lora.apply([("attn.o_proj.lora_A", torch.zeros(5, 8)), ("attn.o_proj.lora_B", torch.zeros(8, 5))])
    with pytest.raises(ValueError, match="do not fit"):  # k_proj's slice has 2 rows, not 8
        lora.apply([("attn.k_proj.lora_A", torch.zeros(2, 8)), ("attn.k_proj.lora_B", torch.zeros(8, 2))])
    with pytest.raises(KeyError, match="no LoRA layer for attn.down_proj"):
        lora.apply([("attn.down_proj.lora_A", torch.zeros(2, 8)), ("attn.down_proj.lora_B", torch.zeros(8, 2))])


def test_slots_find_their_views_again_when_a_buffer_moves():
    layers = _vllm_lora_layers()
    slots = VllmSlots(layers, _VllmLike.packed_modules_mapping, slot=0)
    lora = LoraSlots(1.0, slots.resolve, slots.signature)
    named = [("attn.o_proj.lora_A", torch.ones(2, 8)), ("attn.o_proj.lora_B", torch.ones(8, 2))]
    lora.apply(named)
    moved = _LoraLayer([8], 8)
    layers["attn.o_proj"].lora_a_stacked, layers["attn.o_proj"].lora_b_stacked = moved.lora_a_stacked, moved.lora_b_stacked
    lora.apply(named)
    assert moved.lora_a_stacked[0][0, 0, :2].eq(1).all() and moved.lora_b_stacked[0][0, 0, :, :2].eq(1).all()


def test_slots_write_sources_refilled_in_place_on_every_push_and_new_ones_of_another_dtype():
    """The dtype comparison is made once per set of source tensors (a CUDA IPC receiver hands out the same views each
    push): the same float64 views refilled land again, cast, and new float32 ones replace them."""
    layers = _vllm_lora_layers()
    slots = VllmSlots(layers, _VllmLike.packed_modules_mapping, slot=0)
    lora = LoraSlots(1.0, slots.resolve, slots.signature)
    a, b = torch.ones(2, 8, dtype=torch.float64), torch.ones(8, 2, dtype=torch.float64)
    named = [("attn.o_proj.lora_A", a), ("attn.o_proj.lora_B", b)]
    a_slot, b_slot = layers["attn.o_proj"].lora_a_stacked[0][0, 0], layers["attn.o_proj"].lora_b_stacked[0][0, 0]
    for value in (1.5, 2.5):  # the same objects, refilled in place as the receiver's views are
        a.fill_(value)
        b.fill_(-value)
        lora.apply(named)
        assert a_slot[:2].eq(value).all() and b_slot[:, :2].eq(-value).all()
    lora.apply([("attn.o_proj.lora_A", torch.full((2, 8), 3.0)), ("attn.o_proj.lora_B", torch.full((8, 2), 4.0))])
    assert a_slot[:2].eq(3.0).all() and b_slot[:, :2].eq(4.0).all() and a_slot.dtype == torch.float32


def test_slot_rank_rounds_up_to_vllms_allowed_ranks():
    from rlsys.errors import UserInputError

    assert [slot_rank(r) for r in (1, 2, 8, 16, 17, 64, 300)] == [1, 8, 8, 16, 32, 64, 320]
    with pytest.raises(UserInputError, match="up to rank 512"):
        slot_rank(513)


def test_adapter_serving_is_refused_on_the_transformers_engine():
    from actors.rollout import EngineSettings, build_engine
    from rlsys.errors import UserInputError

    with pytest.raises(ConfigError, match="transformers engine merges"):
        load_config(overrides=[*LORA, "learner.lora.serve=adapter", "rollout.engine=transformers"])
    with pytest.raises(ConfigError, match="cluster.tp_size must be 1"):
        load_config(overrides=[*LORA, "learner.lora.serve=adapter", "cluster.world_size=2", "cluster.tp_size=2"])
    cfg = load_config(overrides=[*LORA, "learner.lora.serve=adapter"])  # engine auto: transformers without a GPU
    settings = EngineSettings(rollout=cfg.rollout, lora=cfg.learner.lora)
    with pytest.raises(UserInputError, match="needs the vLLM engine"):
        build_engine(settings, "unused-model-path")


def test_vllm_engine_serving_the_adapter_names_it_in_every_request_after_set_lora(monkeypatch):
    """`VLLMEngine` over a stand-in AsyncLLM (and vLLM's two sampling classes stubbed: no vLLM on CPU): built with
    `lora_adapter`, `set_lora` asks the workers for the slot path, drops the prefix cache, and from then on every
    request carries rlsys's adapter."""
    import asyncio
    import sys
    from types import ModuleType, SimpleNamespace

    vllm, sampling_params = ModuleType("vllm"), ModuleType("vllm.sampling_params")
    vllm.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    sampling_params.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final_only")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling_params)

    from rlsys.engines.base import SamplingParams
    from rlsys.engines.vllm_engine import VLLMEngine, lora_engine_args

    assert lora_engine_args(12, ["q_proj", "v_proj"]) == {
        "enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 16,
        "lora_target_modules": ["q_proj", "v_proj"]}

    class LLM:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        async def collective_rpc(self, method, args=()):
            self.calls.append((method, args))
            return [None]

        async def reset_prefix_cache(self):
            self.calls.append(("reset_prefix_cache",))

        async def generate(self, prompt, sampling, request_id, lora_request=None):
            self.calls.append(("generate", lora_request))
            out = SimpleNamespace(token_ids=[5], logprobs=[{5: SimpleNamespace(logprob=-0.5)}], finish_reason="length")
            yield SimpleNamespace(outputs=[out])

    llm = LLM()
    engine = VLLMEngine.around(llm, max_model_len=64, vocab_size=16)
    adapter = object()
    engine._lora_request = adapter  # what the constructor sets with lora_adapter (vLLM's LoRARequest)
    params = SamplingParams(max_new_tokens=1)

    async def run():
        await engine.generate([1, 2], params)
        await engine.set_lora(2.0)
        await engine.generate([1, 2], params)

    asyncio.run(run())
    assert llm.calls == [("generate", None), ("rlsys_set_lora", (2.0, "adapter")), ("reset_prefix_cache",),
                         ("generate", adapter)]


def test_the_memory_estimate_counts_the_slot_instead_of_the_kept_base_copy_when_vllm_serves_the_adapter(tmp_path):
    from rlsys.budget import job_estimate
    from rlsys.memory import LORA_KEPT, LORA_SLOT, ModelShape

    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "tie_word_embeddings": True, "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(config))
    targets = 'learner.lora.target_modules=["q_proj","v_proj"]'
    merged = job_estimate(load_config(overrides=[*LORA, targets]), str(tmp_path))
    served = job_estimate(load_config(overrides=[*LORA, targets, "learner.lora.serve=adapter"]), str(tmp_path))
    model = ModelShape.from_config(config)
    assert merged.engine[LORA_KEPT] == model.target_params(("q_proj", "v_proj")) * 2 and LORA_SLOT not in merged.engine
    assert LORA_KEPT not in served.engine
    # q and v are slices of qkv_proj: vLLM wraps the whole layer, k's slice too, at its max rank (4 -> 8)
    assert served.engine[LORA_SLOT] == model.lora_params(8, ("q_proj", "k_proj", "v_proj")) * 2
    assert served.learner == merged.learner


# ------------------------------------------------------------------------------------ learner side
@pytest.fixture(scope="module")
def lora_learner(tmp_path_factory):
    from rlsys.models.tiny import ensure_tiny_model
    from tests.conftest import job_config, make_learner

    path = str(ensure_tiny_model())
    cfg = job_config(tmp_path_factory.mktemp("lora"), *LORA)
    return cfg, path, make_learner(cfg, path)


def test_learner_optimizes_and_pushes_only_the_adapters(lora_learner):
    cfg, _, learner = lora_learner
    trainable = learner.trainable_names()
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = [p for group in learner.optimizer.param_groups for p in group["params"]]
    assert len(optimized) == len(trainable) == learner.num_parameters()
    pushed = [n for n, _ in learner._pushed()]
    layers = learner.model.config.num_hidden_layers
    assert len(pushed) == 2 * layers * len(cfg.learner.lora.target_modules)
    assert pushed[0] == "model.layers.0.self_attn.q_proj.lora_A"
    assert all(not p.requires_grad for n, p in learner.model.named_parameters() if n not in trainable)


def test_adapter_checkpoint_round_trips_and_a_different_rank_is_refused(lora_learner, tmp_path):
    from rlsys.checkpoint import CheckpointError
    from tests.conftest import job_config, make_learner

    cfg, path, learner = lora_learner
    with torch.no_grad():
        for p in learner.params:
            p.add_(0.01)
    learner.save_state(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["r"] == 4 and (tmp_path / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors").exists(), "a LoRA checkpoint holds the adapter, not the base"

    other = make_learner(cfg, path)
    other.load_state(tmp_path)
    mine = dict(learner._pushed())
    for name, tensor in other._pushed():
        assert torch.equal(tensor, mine[name]), f"{name} not restored"

    wrong = make_learner(job_config(tmp_path / "r8", "learner.lora.enabled=true", "learner.lora.rank=8"), path)
    with pytest.raises(CheckpointError, match="learner.lora asks for"):
        wrong.load_state(tmp_path)


def test_export_merge_writes_a_model_with_the_adapted_logits(lora_learner, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlsys.errors import UserInputError
    from rlsys.lora import export_merged, main

    _, path, learner = lora_learner
    with torch.no_grad():
        for p in learner.params:
            p.normal_(0, 0.05)
    learner.save_state(tmp_path / "ckpt")
    assert main(["--merge", str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[5, 9, 17, 33, 2, 71]])
    learner.model.eval()
    with torch.no_grad():
        want = learner.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-3, "the adapter must change the logits for this check to mean anything"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()
    with pytest.raises(UserInputError, match="not a LoRA checkpoint"):
        export_merged(tmp_path / "merged", tmp_path / "again")


# ------------------------------------------------------------------------------------ memory estimate
def test_lora_estimate_keeps_optimizer_state_for_the_adapters_only_and_counts_the_engine_copy():
    from rlsys.memory import JobShape, ModelShape, estimate

    shape = ModelShape(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944,
                       vocab=152064, tied=False)  # Qwen2.5-7B
    qv = ("q_proj", "v_proj")
    adapters = shape.lora_params(16, qv)
    assert adapters == 28 * 16 * ((3584 + 3584) + (512 + 3584))
    full = estimate(shape, JobShape(adam_8bit=False))
    lora = estimate(shape, JobShape(adam_8bit=False, lora_rank=16, lora_targets=qv))
    assert lora.learner["optimizer states"] == 8 * adapters  # two float32 states per adapter parameter
    assert lora.learner["adapter gradients"] == 4 * adapters
    assert lora.learner["frozen base weights"] == full.learner["weights"]
    assert lora.learner_bytes < full.learner_bytes - full.learner["optimizer states"]
    assert lora.engine["kept LoRA base copy"] == 2 * 28 * (3584 * 3584 + 512 * 3584)
    four = estimate(shape, JobShape(adam_8bit=False, lora_rank=16, lora_targets=qv, lora_base_4bit=True))
    assert four.learner["frozen base weights"] < 0.4 * lora.learner["frozen base weights"]
    assert "LoRA r=16" in lora.table()


def test_estimate_from_a_lora_config_uses_its_rank_and_targets():
    from rlsys.memory import JobShape

    cfg = load_config(overrides=[*LORA, 'learner.lora.target_modules=["q_proj"]'])
    shape = JobShape.from_config(cfg)
    assert (shape.lora_rank, shape.lora_targets, shape.lora_base_4bit) == (4, ("q_proj",), False)
    assert JobShape.from_config(load_config()).lora_rank == 0


def test_budget_split_leaves_the_kept_copy_outside_vllms_share():
    from rlsys.memory import CONTEXT_BYTES, GIB, JobShape, ModelShape, estimate

    shape = ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936)
    job = JobShape(mini_bs=1, seq_len=512, max_model_len=1024, lora_rank=16, lora_targets=("q_proj", "v_proj"))
    est = estimate(shape, job, budget_gib=20)
    split = est.split()
    kept = est.engine["kept LoRA base copy"]
    assert kept > 0 and split.engine_outside_bytes == kept
    device = 141 * GIB
    full = estimate(shape, JobShape(mini_bs=1, seq_len=512, max_model_len=1024), budget_gib=20).split()
    assert split.engine_fraction(device) * device == pytest.approx(split.engine_bytes - CONTEXT_BYTES - kept)
    assert full.engine_outside_bytes == 0


def test_lora_learner_shares_prefixes_with_the_plain_forwards_logprobs_and_adapter_gradients(lora_learner):
    from rlsys.prefix import find_prefix_groups, plain_token_logprobs, shared_token_logprobs
    from tests.unit.test_prefix_sharing import _batch, _segments

    _, _, learner = lora_learner
    assert learner.prefix_sharing, "prefix sharing was turned off for the LoRA model"
    model = learner.model
    with torch.no_grad():
        for p in learner.params:
            p.normal_(0, 0.05)  # B != 0: the adapters take part in the forward
    rows = _segments()
    ids, attn, mask = _batch(rows)
    groups = find_prefix_groups([r[0] for r in rows], [r[1] for r in rows])

    def grads(fn):
        model.zero_grad(set_to_none=True)
        lp = fn(model, ids, attn)
        (lp * mask).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp_plain, g_plain = grads(lambda m, i, a: plain_token_logprobs(m, i, a))
    lp_shared, g_shared = grads(lambda m, i, a: shared_token_logprobs(m, i, a, groups))
    model.zero_grad(set_to_none=True)
    sampled = mask.bool()
    torch.testing.assert_close(lp_shared[sampled], lp_plain[sampled], atol=1e-5, rtol=0)
    assert set(g_plain) == set(learner.trainable_names()) == set(g_shared)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_shared[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("extra, gpu, tol, follows", [
    ([], False, "FP32_CANARY_TOL", True),  # float32 on both sides: the engine moves exactly with the learner
    ([], True, "AUTOCAST_CANARY_TOL", False),  # float32 adapters merged into bf16 weights
    (["learner.lora.base_4bit=true"], True, "LORA_4BIT_CANARY_TOL", False),
])
def test_canary_tolerance_and_follow_check_under_lora(extra, gpu, tol, follows):
    import jobs.placement as placement

    cfg = load_config(overrides=[*LORA, *extra])
    assert placement.canary_tolerance(cfg.model, cfg.learner, gpu=gpu) == getattr(placement, tol)
    assert placement.canary_follows(cfg.model, cfg.learner, gpu=gpu) is follows
    full = load_config()
    assert placement.canary_follows(full.model, full.learner, gpu=True) is True
    assert placement.AUTOCAST_CANARY_TOL < placement.LORA_4BIT_CANARY_TOL < 3.8 / 2  # a skipped push reads ~3.8


def test_kl_reference_under_lora_is_the_base_with_the_adapters_off(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from actors.learner_rows import Row, collate
    from rlsys.memory import JobShape, ModelShape, estimate
    from rlsys.prefix import plain_token_logprobs
    from rlsys.types import Segment
    from tests.conftest import job_config, make_learner

    learner = make_learner(job_config(tmp_path, *LORA, "algo.kl_coef=0.1"), tiny_model_path)
    assert learner.ref_model is None, "LoRA loaded a second copy of the base as its KL reference"
    with torch.no_grad():
        for p in learner.params:
            p.normal_(0, 0.05)
    ids = [5, 9, 17, 33, 2, 71, 8, 40]
    rows = [Row(Segment(ids, [0] * 4 + [1] * 4, [0.0] * 8), 1.0, 0)]
    batch = collate(rows, learner.pad_id, learner.device)
    ref = learner._ref_logprobs(rows, batch)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        want = plain_token_logprobs(base, batch["input_ids"], batch["attention_mask"])
        policy = plain_token_logprobs(learner.model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=0)
    assert (policy - want).abs().max() > 1e-3, "the adapters must be switched back on after the reference"
    shape = ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936)
    cfg = load_config(overrides=[*LORA, "algo.kl_coef=0.1"])
    assert "reference model" not in estimate(shape, JobShape.from_config(cfg)).learner


def test_a_lora_checkpoint_as_model_ckpt_resolves_to_a_merged_folder_once(lora_learner, tmp_path, monkeypatch):
    from rlsys.models.resolve import resolve_model

    monkeypatch.setenv("RLSYS_CACHE", str(tmp_path / "cache"))
    _, _, learner = lora_learner
    ckpt = tmp_path / "run" / "checkpoints" / "step_000007"
    learner.save_state(ckpt)
    merged = resolve_model(str(ckpt))
    assert merged.startswith(str(tmp_path / "cache" / "models" / "lora-run-step_000007-"))
    assert resolve_model(str(ckpt)) == merged
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [merged.rsplit("/", 1)[1]], "merged twice"
    with torch.no_grad():
        for p in learner.params:
            p.add_(0.01)
    learner.save_state(ckpt)  # another adapter in the same folder: another merge
    assert resolve_model(str(ckpt)) != merged


def test_vllm_worker_extension_merges_an_object_store_adapter_push_into_fused_weights():
    """actors/vllm_ext.py's LoRA branch as vLLM's worker runs it (set transport, set LoRA, load a pickled payload),
    over the fused layout above; the extension is mixed into a stand-in worker as vLLM mixes it into its own."""
    import pickle
    from types import SimpleNamespace

    from actors.vllm_ext import WorkerExtension
    from rlsys.weights.buckets import BucketPacker
    from rlsys.weights.transport import make_transport

    class Worker(WorkerExtension):
        def __init__(self) -> None:
            self.device = torch.device("cpu")
            self.model_runner = SimpleNamespace(model=_VllmLike())

    torch.manual_seed(1)
    worker = Worker()
    qkv0 = worker.model_runner.model.attn.qkv_proj.weight.detach().clone()
    transport = make_transport("object_store")
    worker.rlsys_set_transport(pickle.dumps(transport))
    worker.rlsys_set_lora(0.5)
    for step in range(2):  # the second push merges from the kept base again
        a, b = torch.randn(3, 8), torch.randn(8, 3)
        named = [("attn.q_proj.lora_A", a), ("attn.q_proj.lora_B", b)]
        info = worker.rlsys_load_weights(pickle.dumps(transport.export(BucketPacker.for_tensors(named).pack(named))))
        assert info["count"] == 2 and info["path"] == "lora_merge" and info["missing"] == []
        assert info["kept_base_mib"] == pytest.approx(8 * 8 * 4 / 2**20)  # q_proj's block of qkv_proj
        got = pickle.loads(worker.rlsys_get_weights())["attn.qkv_proj.weight"]
        torch.testing.assert_close(got[:8], qkv0[:8] + 0.5 * b @ a)
        assert torch.equal(got[8:], qkv0[8:]), f"push {step}: k/v rows moved"


def test_lora_with_gradient_checkpointing_trains_the_adapters(tmp_path, tiny_model_path):
    from tests.conftest import job_config, make_learner
    from tests.faults.test_learner_faults import _trajectories

    learner = make_learner(job_config(tmp_path, *LORA, "model.gradient_checkpointing=true"), tiny_model_path)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    stats = learner.train(_trajectories())
    assert stats["train/skipped_steps"] == 0 and stats["train/grad_norm"] > 0
    moved = {n for n, p in learner.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= set(learner.trainable_names()), "checkpointing cut the adapters' gradient"


def test_keep_awake_auto_counts_the_engines_kept_base_copy(tmp_path):
    from jobs.bench_models import QWEN7B_SIZES
    from jobs.engine_group import AWAKE_DEVICE_SHARE, choose_sleep_level
    from rlsys.budget import job_estimate
    from rlsys.memory import GIB

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **QWEN7B_SIZES}))
    cfg = load_config(overrides=["learner.lora.enabled=true", "rollout.engine=vllm"])
    est = job_estimate(cfg, tmp_path)
    kept = est.engine["kept LoRA base copy"]
    device = 141 * GIB
    engine = int(AWAKE_DEVICE_SHARE * device) - est.learner_bytes - kept // 2  # fits only without the copy
    infos = [{"on_gpu": True, "device_bytes": device, "engine_bytes": engine}]
    level, why = choose_sleep_level(cfg, str(tmp_path), infos)
    assert level == 1 and "kept base copy" in why, why
