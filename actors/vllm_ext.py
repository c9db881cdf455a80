"""The vLLM worker extension: weight loading by CUDA IPC, NCCL broadcast or from CPU buckets inside vLLM's worker.

vLLM mixes this class into its GPU worker when the engine is built with
`worker_extension_cls="actors.vllm_ext.WorkerExtension"` (vLLM's examples/offline_inference/rlhf_utils.py is
the model); `VLLMEngine` calls the methods by name through `collective_rpc`. Payloads arrive pickled
(bytes), so they pass whatever vLLM's RPC serialiser accepts natively.

The engine gives the worker its transport once (`rlsys_set_transport`: a fresh copy of the rollout actor's
`WeightTransport`), and each push is one `rlsys_load_weights(payload)`: the transport turns the payload into named
tensors on this worker's device (CUDA IPC: open each bucket's handle, cached across pushes since the learner reuses
its buffers, and slice views; object store: one H2D copy per bucket; collective: receive the broadcasts), which are
copied into the model. The first push goes through the model's own `load_weights` and then checks a
`DirectCopyPlan` against what it wrote; later pushes use the plan (one fused copy) while it stays valid.
With LoRA (`rlsys_set_lora`) a push carries only adapters, merged in place into the weights they name (q/k/v into
row blocks of qkv_proj, gate/up of gate_up_proj) from a kept copy of the base (rlsys/lora.py `LoraMerge`), or, with
`learner.lora.serve = "adapter"`, written into the GPU slot of the adapter vLLM serves beside the base (`LoraSlots`).
Only parameters are loaded: buffers vLLM keeps (rotary caches) are untouched, and vLLM restores them itself
after a level-2 sleep. The worker synchronises before answering, so the learner may refill its buffers.
"""
from __future__ import annotations

import pickle
import time
from collections.abc import Iterable

import torch


class WorkerExtension:
    def rlsys_set_transport(self, transport: bytes) -> None:
        """The pickled `WeightTransport` this worker receives weights by from now on (rlsys.weights.transport; it
        arrives fresh and keeps its caches, IPC mappings or a joined group, across pushes)."""
        transport = pickle.loads(transport)
        if transport.one_receiver:
            from vllm.distributed.parallel_state import get_world_group

            if get_world_group().world_size != 1:  # tp_size 1: the engine's one worker takes the route's rank
                raise NotImplementedError(f"weight route {transport.route.name}: tensor-parallel engines need a rank "
                                          "per worker (rank offset = the worker's rank, as vLLM's rlhf_utils.py)")
        self._rlsys_transport = transport

    def rlsys_load_weights(self, payload: bytes) -> dict:
        """Load a pickled payload of the transport set by `rlsys_set_transport`; returns {"count", "missing", "path",
        "worker_ms", "plan_refused"}, the transport's counters (CUDA IPC: "opened", "reused") and where the worker's
        time went: "unpickle_ms", "receive_ms" (the transport's views), "apply_ms" (copies or merges, fingerprint
        sums, the device synchronised)."""
        start = time.perf_counter()
        transport = getattr(self, "_rlsys_transport", None)
        if transport is None:
            raise RuntimeError("rlsys_load_weights: no transport set (rlsys_set_transport first)")
        payload = pickle.loads(payload)
        unpickled = time.perf_counter()
        named = list(transport.receive(payload, self.device))
        received = time.perf_counter()
        lora = getattr(self, "_rlsys_lora", None)
        info = self._rlsys_load(named) if lora is None else self._rlsys_merge(lora, named)
        end = time.perf_counter()
        info.update(worker_ms=(end - start) * 1e3, unpickle_ms=(unpickled - start) * 1e3,
                    receive_ms=(received - unpickled) * 1e3, apply_ms=(end - received) * 1e3, **transport.counters())
        return info

    def rlsys_set_lora(self, scale: float, serve: str = "merged") -> None:
        """Pushes from now on are LoRA adapters (`learner.lora.serve`): `merged` = merged as W_base + ``scale`` B A
        (the base kept at the first); `adapter` = written into the GPU slot of a zero adapter registered here in
        vLLM's LoRA manager and pinned there, the one rlsys's requests name (rlsys/lora.py `LoraSlots`)."""
        from rlsys.lora import LoraMerge, VllmTargets

        if serve == "adapter":
            self._rlsys_lora = self._rlsys_adapter_slots(scale)
        elif serve == "merged":
            self._rlsys_lora = LoraMerge(scale, VllmTargets(self._rlsys_model()).resolve)
        else:
            raise ValueError(f"rlsys_set_lora: serve {serve!r} is neither merged nor adapter")

    def rlsys_fingerprint(self) -> dict | None:
        """{HF name: exact bit sum} of what the last push wrote (rlsys/weights/fingerprint.py): the model's weights
        through the direct-copy plan's views, or with LoRA the adapters last merged; None without a valid plan."""
        from rlsys.weights.fingerprint import WordSums

        lora = getattr(self, "_rlsys_lora", None)
        if lora is not None:
            return lora.last_sums
        plan = getattr(self, "_rlsys_plan", None)
        if plan is None or not plan.still_valid():
            return None
        cached = getattr(self, "_rlsys_word_sums", None)  # the plan's views last as long as it does
        if cached is None or cached[0] is not plan:
            cached = self._rlsys_word_sums = (plan, WordSums(zip(plan.names, plan.views)))
        return cached[1]()

    def rlsys_device(self) -> dict:
        """Where this worker's weights live: {"gpu_uuid", "node_id"} (Ray's node id; None outside Ray)."""
        from rlsys.weights.transport import gpu_uuid

        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except ImportError:
            node_id = None
        return {"gpu_uuid": gpu_uuid(self.device), "node_id": node_id}

    def rlsys_get_weights(self, names: list[str] | None = None) -> bytes:
        """Pickled {vLLM parameter name: CPU copy} (all parameters, or those in ``names``)."""
        model = self._rlsys_model()
        wanted = None if names is None else set(names)
        out = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if wanted is None or n in wanted}
        return pickle.dumps(out)

    # ------------------------------------------------------------------ helpers
    def _rlsys_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    @torch.no_grad()
    def _rlsys_load(self, named: list[tuple[str, torch.Tensor]]) -> dict:
        from rlsys.weights.transport import DirectCopyPlan

        model = self._rlsys_model()
        plan = getattr(self, "_rlsys_plan", None)
        if plan is not None and plan.still_valid():
            count, missing, path = plan.copy(named), [], "direct"
        else:
            counted = _Counted(named)
            loaded = model.load_weights(counted)
            count, missing, path = counted.n, _missing_params(model, loaded), "load_weights"
            if getattr(self, "_rlsys_plan_refused", None) is None:
                plan, reason = DirectCopyPlan.build(model, [(n, t.shape, t.dtype) for n, t in named])
                reason = reason or (plan.verify(named) if plan is not None else "")
                self._rlsys_plan = None if reason else plan
                self._rlsys_plan_refused = reason or None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"count": count, "missing": missing, "path": path,
                "plan_refused": getattr(self, "_rlsys_plan_refused", None)}


    def _rlsys_merge(self, lora, named: list[tuple[str, torch.Tensor]]) -> dict:
        count = lora.apply(named)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"count": count, "missing": [], "path": lora.path, "plan_refused": None,
                "kept_base_mib": lora.kept_bytes() / 2**20}

    def _rlsys_adapter_slots(self, scale: float):
        """A `LoraSlots` over the GPU slot of rlsys's adapter: registered once as a zero adapter of the engine's
        `max_lora_rank` (vLLM's own warm-up path, `add_dummy_lora`), pinned, which activates it into a slot that
        no other adapter can take; requests naming its id then find it loaded and never read its path."""
        from vllm.lora.request import LoRARequest

        from rlsys.lora import ADAPTER_ID, ADAPTER_NAME, ADAPTER_PATH, LoraSlots, VllmSlots

        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("learner.lora.serve = adapter: this vLLM engine was built without enable_lora")
        if ADAPTER_ID not in manager.list_adapters():
            manager.add_dummy_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH),
                                   rank=manager.lora_config.max_lora_rank)
        manager.pin_adapter(ADAPTER_ID)
        models = manager._adapter_manager  # vLLM's LoRAModelManager: its layers, fused-module map, slot table
        slots = VllmSlots(models.modules, models.packed_modules_mapping, models.lora_index_to_id.index(ADAPTER_ID))
        return LoraSlots(scale, slots.resolve, slots.signature)


class _Counted:
    """Iterates (name, tensor) pairs and counts how many the model's `load_weights` consumed."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._items = items
        self.n = 0

    def __iter__(self):
        for item in self._items:
            self.n += 1
            yield item


def _missing_params(model: torch.nn.Module, loaded) -> list[str] | None:
    """Parameters `load_weights` did not report as loaded; None when it reports nothing to check against."""
    if not loaded:
        return None
    loaded = set(loaded)
    return sorted(n for n, _ in model.named_parameters()
                  if n not in loaded and not any(n.endswith(x) or x.endswith(n) for x in loaded))
