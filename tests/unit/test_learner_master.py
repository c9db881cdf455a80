"""`learner.fp32_master`: fp32 weights and updates, 16-bit compute, 16-bit pushes.

Why it exists: in bf16 an Adam update of ~lr is rounded away on most weights (ulp of 0.02 is 1.2e-4), so a
bf16 learner at lr 1e-5 barely moves. The test trains both ways on the same batch and counts what moved.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import job_config
from tests.faults.test_learner_faults import _trajectories

pytestmark = pytest.mark.timeout(300)


def _moved_fraction(learner, before: dict[str, torch.Tensor]) -> float:
    moved = total = 0
    for name, p in learner.model.named_parameters():
        moved += int((p.detach().float() != before[name]).sum())
        total += p.numel()
    return moved / total


@pytest.mark.parametrize("master", [True, False], ids=["fp32_master", "bf16"])
def test_small_updates_survive_only_with_fp32_masters(tmp_path, tiny_model_path, master):
    from tests.conftest import make_learner

    cfg = job_config(tmp_path, "model.dtype=bfloat16", f"learner.fp32_master={str(master).lower()}", lr="1e-6")
    learner = make_learner(cfg, tiny_model_path)
    dtypes = {p.dtype for p in learner.model.parameters()}
    assert dtypes == ({torch.float32} if master else {torch.bfloat16})
    before = {n: p.detach().float().clone() for n, p in learner.model.named_parameters()}
    stats = learner.train(_trajectories())
    assert stats["train/skipped_steps"] == 0.0 and learner.optimizer_steps == 1
    moved = _moved_fraction(learner, before)
    if master:
        assert moved > 0.9, moved  # Adam's first step moves every weight with a gradient by ~lr
    else:
        assert moved < 0.5, moved  # most 1e-6 steps are below half a bf16 ulp

    # pushes carry the engine's dtype: bf16, whatever the masters are
    from rlsys.weights.buckets import unpack_bucket
    from rlsys.weights.transport import make_transport

    learner.open_transports([make_transport("object_store")])
    payload = learner.export_weights()

    pushed = dict(t for bucket in payload for t in unpack_bucket(bucket))
    assert {t.dtype for t in pushed.values()} == {torch.bfloat16}
    for name, p in learner.model.named_parameters():
        assert torch.equal(pushed[name], p.detach().to(torch.bfloat16)), name


def test_fp32_master_scores_like_the_bf16_model(tmp_path, tiny_model_path):
    """The canary's reference (`score`) runs under autocast: close to a pure bf16 model, not to fp32."""
    from tests.conftest import make_learner

    prompt, continuation = list(range(5, 40)), [41, 42, 43, 44]
    master = make_learner(job_config(tmp_path, "model.dtype=bfloat16", "learner.fp32_master=true"), tiny_model_path)
    plain = make_learner(job_config(tmp_path, "model.dtype=bfloat16"), tiny_model_path)
    a, b = master.score(prompt, continuation), plain.score(prompt, continuation)
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.05


def test_weights_digest_is_equal_for_equal_weights_and_moves_with_one_element():
    from actors.learner_rows import weights_digest

    torch.manual_seed(0)
    a = [torch.randn(64, 32).to(torch.bfloat16), torch.randn(1000)]
    b = [t.clone() for t in a]
    assert weights_digest(a) == weights_digest(b)
    b[0].view(-1)[17] += 0.125  # one bf16 element of 3048 values
    assert not torch.equal(a[0], b[0]) and weights_digest(b) != weights_digest(a)
    b = [t.clone() for t in a]
    b[1][3] = -b[1][3]  # a sign flip: the sum moves, the sum of squares does not
    assert weights_digest(b) != weights_digest(a)
