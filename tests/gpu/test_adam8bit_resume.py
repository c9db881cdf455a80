"""8-bit Adam across a checkpoint: bitsandbytes' states survive `save_state` / `load_state` in a new process.

The learner trains two SFT steps with `learner.adam_8bit` on a fixed batch and checkpoints; the uninterrupted run
then takes a third step. A fresh Python process builds a learner from the checkpoint folder, loads its state and
takes the same third step. The optimizer state it loaded must equal the one saved, tensor for tensor (the 8-bit
states, their absmax and quantisation maps), and the third step's loss and the weights after it must equal the
uninterrupted run's. SFT: its loss is the batch's cross-entropy, a number that depends on every weight (GSPO's
with one minibatch is ~0 whatever the weights are).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.conftest import REPO, measure, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.timeout(600)]


def learner_config():
    from rlsys.config import load_config

    return load_config(flags={"--algo": "sft", "--lr": "1e-3"},
                       overrides=["learner.adam_8bit=true", "model.dtype=bfloat16"])


def fixed_batch(vocab: int) -> list:
    """Eight sequences of 48 tokens (the last 24 sampled), the same in every process."""
    import torch

    from rlsys.types import Segment, Trajectory

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        ids = torch.randint(3, vocab, (48,), generator=gen).tolist()
        seg = Segment(ids, [0] * 24 + [1] * 24, [0.0] * 24 + [-1.0] * 24)
        out.append(Trajectory(item_id=f"b{i}", group=i, sample=0, segments=[seg], reward=1.0))
    return out


def flat_state(optimizer) -> dict:
    """The optimizer's state dict as {"<param index>/<key>": tensor on CPU} (bitsandbytes' 8-bit states included)."""
    import torch

    out = {}

    def walk(prefix: str, value) -> None:  # bitsandbytes nests its quantisation states in a dict of their own
        if torch.is_tensor(value):
            out[prefix] = value.detach().cpu().clone()
        elif isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}", inner)

    for index, state in optimizer.state_dict()["state"].items():
        walk(str(index), state)
    return out


def step_and_record(learner, batch, path: str) -> dict:
    """One more training step; its loss, and the weights after it, saved to ``path``."""
    import torch

    stats = learner.train(batch)
    torch.save({n: t.detach().cpu() for n, t in learner.model.named_parameters()}, path)
    return {"loss": stats["train/loss"], "skipped": stats["train/skipped_steps"]}


def resumed_run(model_path: str, ckpt: str, out_dir: str) -> None:
    """The new process: learner from the checkpoint folder, its state loaded, the optimizer state saved for
    comparison, then the third step."""
    import torch

    from tests.conftest import make_learner

    learner = make_learner(learner_config(), ckpt)
    steps = learner.load_state(ckpt)
    torch.save(flat_state(learner.optimizer), os.path.join(out_dir, "loaded_state.pt"))
    result = step_and_record(learner, fixed_batch(learner.model.config.vocab_size), os.path.join(out_dir, "resumed.pt"))
    print("RESUMED " + json.dumps({**result, "optimizer_steps": steps}), flush=True)


def test_adam_8bit_state_and_next_step_survive_a_resume_in_a_new_process(tmp_path, gpu_tiny_path):
    import torch

    from tests.conftest import make_learner

    learner = make_learner(learner_config(), gpu_tiny_path)
    assert type(learner.optimizer).__module__.startswith("bitsandbytes"), type(learner.optimizer)
    batch = fixed_batch(learner.model.config.vocab_size)
    for _ in range(2):
        assert learner.train(batch)["train/skipped_steps"] == 0
    ckpt = tmp_path / "ckpt"
    learner.save_state(ckpt)
    saved = flat_state(learner.optimizer)
    at_ckpt = {n: t.detach().cpu().clone() for n, t in learner.model.named_parameters()}
    assert any(t.dtype == torch.uint8 for t in saved.values()), "no 8-bit state: not bitsandbytes' 8-bit Adam?"
    straight = step_and_record(learner, batch, str(tmp_path / "straight.pt"))

    code = ("import sys; from tests.gpu.test_adam8bit_resume import resumed_run; "
            "resumed_run(sys.argv[1], sys.argv[2], sys.argv[3])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, gpu_tiny_path, str(ckpt), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESUMED "))[8:])

    loaded = torch.load(tmp_path / "loaded_state.pt")
    assert set(loaded) == set(saved)
    differ = [k for k in saved if saved[k].dtype != loaded[k].dtype or not torch.equal(saved[k], loaded[k])]
    assert differ == [], f"optimizer state changed in the round trip: {differ[:5]}"
    assert resumed["optimizer_steps"] == 2
    measure("adam8bit_resume_loss_straight", straight["loss"])
    measure("adam8bit_resume_loss_resumed", resumed["loss"])
    assert resumed["skipped"] == straight["skipped"] == 0
    # the same weights and batch in another process: the bf16 forward may pick other kernels there (measured on the
    # H200: 5.923682 vs 5.923723, 7e-6 relative); a lost or reset optimizer state moves it by orders more
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-4)
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    moved = sum(int((a[n] != at_ckpt[n]).sum()) for n in a) / sum(t.numel() for t in a.values())
    differ = sum(int((a[n] != b[n]).sum()) for n in a) / sum(t.numel() for t in a.values())
    measure("adam8bit_resume_weights_moved_frac", moved)
    measure("adam8bit_resume_weights_differ_frac", differ)
    # the same update from the same state: the third step moved most bf16 weights, and the resumed run's weights
    # equal the uninterrupted run's but for the few the backward's atomics (embedding gradients) may round apart, or
    # that another process's kernels round apart: measured on the H200 0 alone and 0.012 beside four training runs
    # (whose load made the resumed forward pick other kernels: loss 5.92372 vs 5.92368). A lost or reset state moves
    # about as many as the step itself (`moved`, 0.96), so 0.1 still tells the two apart
    assert moved > 0.5, moved
    assert differ <= 0.1, differ
