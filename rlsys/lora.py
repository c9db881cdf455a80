"""LoRA (`learner.lora`): adapters trained on a frozen base, pushed alone, merged into the engine's weights.

Learner side: `load_lora_policy` loads the base (bf16, or 4-bit NF4 through bitsandbytes with
`learner.lora.base_4bit`) and wraps it with peft's LoRA, so only the adapters require gradients and reach the
optimizer. A push carries only them (`adapter_tensors`), named `<HF module>.lora_A` (r, in) and `<HF module>.lora_B`
(out, r): peft's `base_model.model.` prefix and adapter name are dropped, so the names say which base weight
(`<HF module>.weight`) they update, whatever engine receives them.

Engine side, two ways (`learner.lora.serve`):
- `merged`: `LoraMerge` writes W = W_base + (alpha / r) B A in place into the engine's own weights, from a copy of
  the base of every targeted layer that it keeps from the first push (one `addmm` per layer, no drift: the delta is
  never accumulated). The transformers engine's weights are the Hugging Face ones; vLLM's fuse q/k/v into
  `qkv_proj` and gate/up into `gate_up_proj`, and `VllmTargets` finds each layer's row block there. This needs no
  LoRA kernels in the engine, at the price of the kept copy (counted in rlsys/memory.py) and of rewriting every
  targeted weight each push.
- `adapter`: vLLM serves the base plus the adapter through its own LoRA layers (`enable_lora`, one GPU slot holding
  a zero adapter registered once, rlsys's requests naming it); `LoraSlots` copies each pushed A and scale x B into
  that slot's buffers (`VllmSlots` finds them). The base is never written and no copy of it is kept; every forward
  runs vLLM's LoRA kernels. docs/lora-vllm-serving.md has what this relies on in vLLM.

Checkpoints hold the adapter in peft's format (`adapter_config.json`, `adapter_model.safetensors`);
`export_merged` (`rlsys export --merge`) writes base + adapter as one Hugging Face folder.

peft is imported lazily (it takes seconds): `import rlsys.lora` costs torch only, so vLLM's worker extension uses it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rlsys.errors import UserInputError
from rlsys.weights.fingerprint import ViewSums

ADAPTER_PARTS = ("lora_A", "lora_B")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PARAM = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.([^.]+)\.weight$")


def split_adapter_name(name: str) -> tuple[str, str]:
    """`model.layers.0.self_attn.q_proj.lora_A` -> (`model.layers.0.self_attn.q_proj`, `lora_A`)."""
    module, _, part = name.rpartition(".")
    if part not in ADAPTER_PARTS or not module:
        raise ValueError(f"LoRA push: {name!r} is not an adapter tensor (<module>.lora_A or <module>.lora_B); "
                         "is the learner pushing full weights to an engine set up for LoRA?")
    return module, part


def adapter_pairs(names: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """(index of A, index of B, module) of every layer in a push's names; refuses a half pair."""
    halves: dict[str, dict[str, int]] = {}
    for i, name in enumerate(names):
        module, part = split_adapter_name(name)
        halves.setdefault(module, {})[part] = i
    for module, parts in halves.items():
        if len(parts) != 2:
            raise ValueError(f"LoRA push: {module} came with {sorted(parts)} only; lora_A and lora_B travel together")
    return [(parts["lora_A"], parts["lora_B"], module) for module, parts in halves.items()]


# ------------------------------------------------------------------------------------------- learner side
def load_lora_policy(path: str, lora: Any, device: torch.device, dtype: torch.dtype,
                     trust_remote_code: bool = False, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """The base at ``path`` (frozen, in ``dtype`` or 4-bit) wrapped with peft's LoRA as `learner.lora` (``lora``)
    says: a PeftModel whose only trainable parameters are the adapters (float32, peft's default)."""
    from peft import LoraConfig as PeftLoraConfig  # noqa: PLC0415 (seconds to import: only on the LoRA path)
    from peft import get_peft_model  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if lora.base_4bit:
        kwargs.update(quantization_config=_four_bit_config(device, dtype), device_map={"": device.index or 0})
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not lora.base_4bit:
        model = model.to(device)
    linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = sorted(set(lora.target_modules) - set(linear))
    if missing:
        raise UserInputError(f"learner.lora.target_modules: {missing} are not linear layers of {path}; "
                             f"its linear layers are {linear}")
    if gradient_checkpointing:  # the frozen embeddings give no input that requires grad: checkpointing needs one
        model.enable_input_require_grads()
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _four_bit_config(device: torch.device, dtype: torch.dtype) -> Any:
    if device.type != "cuda":
        raise RuntimeError("learner.lora.base_4bit needs CUDA (bitsandbytes' 4-bit kernels); drop it on CPU")
    try:
        import bitsandbytes  # noqa: F401, PLC0415
    except ImportError as err:
        raise RuntimeError(f"learner.lora.base_4bit: bitsandbytes is not importable ({err}); "
                           "pip install 'rlsys[gpu]'") from None
    from transformers import BitsAndBytesConfig  # noqa: PLC0415

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every adapter matrix of a peft model, `<HF module>.lora_A` / `.lora_B`, in module order."""
    out = []
    adapters = set()
    for name, param in model.named_parameters():
        match = _PEFT_PARAM.match(name)
        if match:
            module, part, adapter = match.groups()
            adapters.add(adapter)
            out.append((f"{module}.{part}", param))
    if len(adapters) > 1:
        raise RuntimeError(f"LoRA: the model holds adapters {sorted(adapters)}; rlsys trains and pushes one")
    if not out:
        raise RuntimeError("LoRA: the model has no lora_A/lora_B parameters (not wrapped by load_lora_policy?)")
    return out


def load_adapter(model: torch.nn.Module, path: str | Path, lora: Any) -> None:
    """Load a checkpoint's peft adapter (``path``: a folder `save_pretrained` of a peft model wrote) into
    ``model`` in place; refuses one of another rank, alpha or target set, or with missing / unexpected tensors."""
    from peft import set_peft_model_state_dict  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    from rlsys.checkpoint import CheckpointError  # noqa: PLC0415

    path = Path(path)
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise CheckpointError(f"checkpoint {path}: no {ADAPTER_CONFIG} / {ADAPTER_WEIGHTS}: not a LoRA checkpoint, "
                              "but learner.lora.enabled is set (resume a LoRA run with LoRA on, a full one with it "
                              "off)")
    saved = json.loads(config_file.read_text())
    want = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}
    have = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha"),
            "target_modules": sorted(saved.get("target_modules") or [])}
    if have != want:
        raise CheckpointError(f"checkpoint {path}: its adapter is {have}, learner.lora asks for {want}")
    device = next(p.device for p in model.parameters())
    result = set_peft_model_state_dict(model, load_file(str(weights), device=str(device)))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint {path}: adapter tensors missing {missing[:3]} or unexpected "
                              f"{list(result.unexpected_keys)[:3]}")


# -------------------------------------------------------------------------------------------- engine side
class LoraMerge:
    """Engine side of a LoRA push: for each layer of the push, W = W_base + scale B A written in place.

    ``resolve(module)`` gives the engine tensor that holds `<module>.weight` (a parameter, or a row block of a fused
    one) and the parameter that owns it. The first push of a layer keeps a copy of that tensor as its base (the
    engine holds the base then: it loaded `model.ckpt`, and LoRA jobs never drop weights by a level-2 sleep); every
    push recomputes from that copy, so merges never accumulate rounding. Views are re-resolved when the owner's
    storage moved.
    """

    path = "lora_merge"  # the worker's report of a push names how it was applied

    def __init__(self, scale: float, resolve: Callable[[str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.scale = float(scale)
        self._resolve = resolve
        self._targets: dict[str, list] = {}  # module -> [dst view, owner parameter, owner's data_ptr, base copy]
        self._plan: tuple[tuple[str, ...], list[tuple[int, int, str]]] | None = None  # the last push's names, pairs
        self.last_sums: dict[str, int] | None = None  # bit sums of the adapters last merged (a push's fingerprint)
        self._sums = ViewSums()

    def kept_bytes(self) -> int:
        """Memory of the kept base copies."""
        return sum(t[3].numel() * t[3].element_size() for t in self._targets.values())

    @torch.no_grad()
    def apply(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Merge every (A, B) pair of ``named`` into its layer; returns the number of adapter tensors consumed."""
        named = list(named)
        names = tuple(n for n, _ in named)
        plan = self._plan if self._plan is not None and self._plan[0] == names else None
        if plan is None:  # pushes repeat the same names in the same order: parse them once
            plan = self._plan = (names, adapter_pairs(names))
        for i_a, i_b, module in plan[1]:
            a, b = named[i_a][1], named[i_b][1]  # (r, in), (out, r)
            dst, base = self._target(module)
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != dst.shape:
                raise ValueError(f"LoRA push: {module}: B {tuple(b.shape)} A {tuple(a.shape)} do not make the "
                                 f"engine's {tuple(dst.shape)} weight")
            if a.dtype != dst.dtype or a.device != dst.device:  # the learner sends the engine's dtype: no cast
                a, b = a.to(dst.device, dst.dtype), b.to(dst.device, dst.dtype)
            if dst.is_contiguous():
                torch.addmm(base, b, a, alpha=self.scale, out=dst)  # one kernel: base + scale * (B @ A)
            else:
                dst.copy_(torch.addmm(base, b, a, alpha=self.scale))
        self.last_sums = self._sums(named)  # as received: the learner sends the engine's dtype
        return len(named)

    def _target(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._targets.get(module)
        if entry is not None and entry[1].data_ptr() != entry[2]:  # the owner's storage moved: find the view again
            dst, owner = self._resolve(module)
            entry[:3] = [dst, owner, owner.data_ptr()]
        if entry is None:
            dst, owner = self._resolve(module)
            entry = [dst, owner, owner.data_ptr(), dst.detach().clone()]
            self._targets[module] = entry
        return entry[0], entry[3]


class VllmTargets:
    """`LoraMerge`'s resolver over a vLLM model (tensor parallel size 1): `<HF module>.weight` is either a parameter
    of that name or a row block of a fused one (the model's `packed_modules_mapping`, e.g. q/k/v -> qkv_proj), whose
    shard sizes the fused layer lists in `output_sizes` (vLLM's QKVParallelLinear / MergedColumnParallelLinear)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})

    def resolve(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        param = self.params.get(f"{module}.weight")
        if param is not None:
            return param.data, param
        prefix, _, leaf = module.rpartition(".")
        for fused, shards in self.packed.items():
            if leaf not in shards:
                continue
            fused_module = f"{prefix}.{fused}" if prefix else fused
            param = self.params.get(f"{fused_module}.weight")
            sizes = [int(s) for s in getattr(self.model.get_submodule(fused_module), "output_sizes", None) or []]
            if param is None or len(sizes) != len(shards) or sum(sizes) != param.shape[0]:
                raise NotImplementedError(
                    f"LoRA merge: {module} is a shard of {fused_module}, whose shard sizes {sizes} do not add up to "
                    f"its {None if param is None else tuple(param.shape)} weight (tensor parallel or quantized "
                    "engines are not supported by the in-place merge)")
            i = shards.index(leaf)
            return param.data.narrow(0, sum(sizes[:i]), sizes[i]), param
        raise KeyError(f"LoRA merge: the engine has no weight {module}.weight, nor a fused layer holding it")


ADAPTER_NAME = "rlsys"  # the adapter every request names under `learner.lora.serve = "adapter"`
ADAPTER_ID = 1000  # vLLM's int id of it: not 1..max_loras, which vLLM's warm-up registers and then removes
# a LoRARequest needs a path; an absolute one that does not exist is never read (the adapter is registered from
# memory first) and cannot be mistaken for a hub id
ADAPTER_PATH = "/nonexistent/rlsys-adapter-in-memory"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.26's `max_lora_rank` choices


def slot_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of ``rank``: the smallest allowed one that holds it."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise UserInputError(f"learner.lora.rank = {rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}; "
                         "lower it or use learner.lora.serve = \"merged\"")


class LoraSlots:
    """Engine side of a LoRA push under `learner.lora.serve = "adapter"`: each pushed A and scale x B copied into the
    GPU slot of the adapter that vLLM serves beside the untouched base.

    ``resolve(module)`` gives the slot's (A buffer, B buffer) for `<HF module>.weight`, of shapes (max rank, in)
    and (out, max rank) (`VllmSlots`); an adapter of a lower rank fills their first r rows / columns, and the rest
    stays zero (the registered zero adapter's). vLLM applies B A unscaled, so B is stored times the scale, as vLLM
    does when it loads an adapter. The views are found once per set of names (pushes repeat them) and again when
    ``signature()`` says a buffer moved; each push is then one fused copy and one fused scale.
    """

    path = "lora_slots"

    def __init__(self, scale: float, resolve: Callable[[str], tuple[torch.Tensor, torch.Tensor]],
                 signature: Callable[[], tuple[int, ...]] = tuple) -> None:
        self.scale = float(scale)
        self._resolve = resolve
        self._signature = signature
        self._plan: tuple[tuple[str, ...], tuple[int, ...], list[int], list[torch.Tensor], list[torch.Tensor]] | None
        self._plan = None  # names, buffers' signature, source indices, destination views, the B views among them
        self.last_sums: dict[str, int] | None = None  # bit sums of the adapters last written (a push's fingerprint)
        self._sums = ViewSums()
        self._checked: list[torch.Tensor] = []  # the sources whose dtype and device were last compared
        self._cast = False  # whether they differ from the slots' (then each push casts)

    def kept_bytes(self) -> int:
        """No copy of the base is kept (the slot buffers are vLLM's, counted in its weights)."""
        return 0

    @torch.no_grad()
    def apply(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write every (A, B) pair of ``named`` into its slot; returns the number of adapter tensors consumed."""
        named = list(named)
        names = tuple(n for n, _ in named)
        signature = tuple(self._signature())
        if self._plan is None or self._plan[0] != names or self._plan[1] != signature:
            self._plan = (names, signature, *self._views(named))
            self._checked = []  # new destinations: compare again
        _, _, index, dsts, b_dsts = self._plan
        srcs = [named[i][1] for i in index]
        if len(srcs) != len(self._checked) or any(s is not c for s, c in zip(srcs, self._checked)):
            # a CUDA IPC receiver hands out the same views every push: compared once, not per push
            self._cast = any(s.dtype != d.dtype or s.device != d.device for s, d in zip(srcs, dsts))
            self._checked = srcs
        if self._cast:  # the learner sends the engine's dtype: normally no cast
            srcs = [s.to(d.device, d.dtype) for s, d in zip(srcs, dsts)]
        torch._foreach_copy_(dsts, srcs)
        if self.scale != 1.0:
            torch._foreach_mul_(b_dsts, self.scale)
        self.last_sums = self._sums(named)  # as received, as LoraMerge
        return len(named)

    def _views(self, named: list[tuple[str, torch.Tensor]]) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        index: list[int] = []
        dsts: list[torch.Tensor] = []
        b_dsts: list[torch.Tensor] = []
        for i_a, i_b, module in adapter_pairs(tuple(n for n, _ in named)):
            a, b = named[i_a][1], named[i_b][1]  # (r, in), (out, r)
            a_slot, b_slot = self._resolve(module)  # (R, in), (out, R)
            r = a.shape[0] if a.dim() == 2 else -1
            if (a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or a.shape[1] != a_slot.shape[1]
                    or b.shape[0] != b_slot.shape[0] or r > a_slot.shape[0]):
                raise ValueError(f"LoRA push: {module}: B {tuple(b.shape)} A {tuple(a.shape)} do not fit the engine's "
                                 f"adapter slot (A {tuple(a_slot.shape)}, B {tuple(b_slot.shape)}: out x in at most "
                                 f"rank {a_slot.shape[0]})")
            index += [i_a, i_b]
            dsts += [a_slot[:r], b_slot[:, :r]]
            b_dsts.append(dsts[-1])
        return index, dsts, b_dsts


class VllmSlots:
    """`LoraSlots`' resolver over vLLM's LoRA layers (tensor parallel size 1). ``layers``: vLLM module name
    (`model.layers.0.self_attn.qkv_proj`) -> its LoRA layer, whose `lora_a_stacked[s]` is (slots, 1, max rank, in)
    and `lora_b_stacked[s]` (slots, 1, out_s, max rank) for each slice s of a fused layer (vLLM's
    `LoRAModelManager.modules`); ``packed``: the model's `packed_modules_mapping` (qkv_proj -> [q_proj, k_proj,
    v_proj], the slices' order); ``slot``: the GPU slot the adapter was activated in."""

    def __init__(self, layers: dict[str, Any], packed: dict[str, list[str]], slot: int) -> None:
        self.layers = layers
        self.packed = packed
        self.slot = slot

    def resolve(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        layer, part = self.layers.get(module), 0
        if layer is None:
            prefix, _, leaf = module.rpartition(".")
            for fused, shards in self.packed.items():
                found = self.layers.get(f"{prefix}.{fused}" if prefix else fused)
                if leaf in shards and found is not None:
                    layer, part = found, shards.index(leaf)
                    break
        if layer is None:
            raise KeyError(f"LoRA slots: vLLM has no LoRA layer for {module} (not among the engine's LoRA target "
                           "modules?)")
        a_stacked, b_stacked = layer.lora_a_stacked, layer.lora_b_stacked
        if part >= len(a_stacked):
            raise KeyError(f"LoRA slots: {module} is slice {part} of a layer with {len(a_stacked)}")
        return a_stacked[part][self.slot, 0], b_stacked[part][self.slot, 0]

    def signature(self) -> tuple[int, ...]:
        """Where every slot buffer lives (`LoraSlots` finds its views again when this changes)."""
        return tuple(t.data_ptr() for layer in self.layers.values()
                     for t in (*layer.lora_a_stacked, *layer.lora_b_stacked))


# ------------------------------------------------------------------------------------------------- export
def export_merged(checkpoint: str | Path, out: str | Path, base: str | None = None) -> Path:
    """Base + the checkpoint's adapter merged into one Hugging Face folder at ``out`` (weights in the base's dtype,
    tokenizer from the checkpoint), loadable by transformers and vLLM. ``base``: the base model folder; unset = the
    one the adapter was trained on (its `adapter_config.json` names it)."""
    from peft import PeftModel  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from rlsys.models.resolve import resolve_model  # noqa: PLC0415

    checkpoint, out = Path(checkpoint), Path(out)
    config_file = checkpoint / ADAPTER_CONFIG
    if not config_file.is_file():
        raise UserInputError(f"export --merge: {checkpoint} has no {ADAPTER_CONFIG}: not a LoRA checkpoint (a full "
                             "checkpoint already is a Hugging Face folder)")
    if out.exists() and any(out.iterdir()):
        raise UserInputError(f"export --merge: {out} exists and is not empty")
    base = base or json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise UserInputError(f"export --merge: {config_file} names no base model; pass --base")
    model = AutoModelForCausalLM.from_pretrained(resolve_model(base), dtype="auto")
    merged = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
    merged.save_pretrained(out)
    tokenizer_source = checkpoint if (checkpoint / "tokenizer_config.json").is_file() else resolve_model(base)
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(out)
    return out


def ensure_merged_folder(checkpoint: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A LoRA checkpoint as a model folder, for whatever loads `model.ckpt` (`rlsys eval`, `rlsys play`, a run that
    starts from it): merged on first use (`export_merged`) into ${RLSYS_CACHE:-~/.cache/rlsys}/models/
    lora-<run>-<step>-<key>, the key hashing the adapter's files; staged and renamed into place (as gguf.py does)."""
    import hashlib  # noqa: PLC0415

    from rlsys.models.tiny import default_cache_root, publish_folder  # noqa: PLC0415

    src = Path(checkpoint).expanduser().resolve()
    digest = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):  # adapters are megabytes: hash them whole
        digest.update((src / name).read_bytes())
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / "models" / f"lora-{src.parent.parent.name[:32]}-{src.name[:24]}-{digest.hexdigest()[:12]}"
    if (final / "config.json").is_file():
        return final
    return publish_folder(final, lambda staging: export_merged(src, staging))


def main(argv: list[str] | None = None) -> int:
    """`rlsys export --merge CHECKPOINT OUT [--base BASE]`."""
    parser = argparse.ArgumentParser(prog="rlsys export", description="Write a LoRA checkpoint as a merged Hugging "
                                     "Face model folder (base + adapter), which transformers and vLLM load.")
    parser.add_argument("--merge", action="store_true", required=True,
                        help="merge the adapter into the base weights (the only export there is)")
    parser.add_argument("checkpoint", help="a LoRA checkpoint folder (checkpoints/step_NNNNNN)")
    parser.add_argument("out", help="the folder to write (must not exist or be empty)")
    parser.add_argument("--base", help="the base model (default: the one named in the adapter's config)")
    args = parser.parse_args(argv)
    try:
        path = export_merged(args.checkpoint, args.out, args.base)
    except UserInputError as err:
        print(f"rlsys: {err}", file=sys.stderr)
        return 2
    print(f"rlsys: merged model written to {path}")
    return 0
