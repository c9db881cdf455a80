"""The learner's `train/entropy`, `algo.entropy_coef` (a bonus), `algo.entropy_target` (the bonus's adaptive
coefficient), `algo.kl_coef` (k3 KL to a frozen reference) and `algo.kl_decay` (its schedule)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import job_config
from tests.faults.test_learner_faults import _trajectories

pytestmark = pytest.mark.timeout(300)


def _same_reward(trajs):
    """One group whose rewards all agree: no advantage, no policy-gradient signal."""
    for t in trajs:
        t.reward = 0.5
    return trajs


def _entropy_now(learner) -> float:
    rows, _ = learner._policy_rows(_trajectories())
    return learner._logp_diff(rows)["train/entropy"]


@pytest.mark.parametrize("sharing", [True, False], ids=["prefix-sharing", "plain"])
def test_entropy_is_logged_by_default_and_nothing_else_changes(tmp_path, tiny_model_path, sharing):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, f"learner.prefix_sharing={str(sharing).lower()}"), tiny_model_path)
    assert learner.ref_model is None  # kl_coef = 0: no reference loaded
    stats = learner.train(_trajectories())
    assert 0.0 < stats["train/entropy"] < torch.log(torch.tensor(learner.model.config.vocab_size)).item()
    assert "train/kl_ref" not in stats
    # a step without signal still measures it (on the stale-weights alarm's forward), and moves nothing
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    idle = learner.train(_same_reward(_trajectories()))
    assert idle["train/entropy"] > 0.0 and idle["train/active_frac"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())


def test_entropy_bonus_moves_a_batch_without_signal_towards_more_entropy(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.entropy_coef=1.0"), tiny_model_path)
    start = _entropy_now(learner)
    for _ in range(3):
        stats = learner.train(_same_reward(_trajectories()))
        assert stats["train/active_frac"] == 1.0  # every sequence ran: the bonus has a gradient on each
    assert _entropy_now(learner) > start + 1e-4


def test_kl_penalty_loads_a_frozen_reference_and_measures_the_drift(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.kl_coef=0.1"), tiny_model_path)
    ref = learner.ref_model
    assert ref is not None and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters()}
    first = learner.train(_trajectories())
    assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference
    for _ in range(2):
        later = learner.train(_trajectories())
    assert later["train/kl_ref"] > 1e-6
    for name, p in ref.named_parameters():  # the reference did not move
        assert torch.equal(p, frozen[name]), f"{name}: the reference moved"


def test_kl_penalty_alone_moves_no_weights_while_the_policy_is_the_reference(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.kl_coef=1.0"), tiny_model_path)
    stats = learner.train(_same_reward(_trajectories()))
    assert stats["train/active_frac"] == 1.0 and stats["train/kl_ref"] == 0.0
    assert stats["train/grad_norm"] == 0.0  # k3's gradient vanishes at policy == reference


def test_a_resumed_learner_compares_against_the_initial_model_not_the_checkpoint(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    cfg = job_config(tmp_path, "algo.kl_coef=0.1")
    trained = make_learner(cfg, tiny_model_path)
    for _ in range(2):
        trained.train(_trajectories())
    ckpt = tmp_path / "ckpt"
    trained.save_state(ckpt)

    resumed = make_learner(cfg, str(ckpt))  # what the job does on --resume: the policy from the checkpoint
    resumed.load_state(ckpt)
    initial = make_learner(job_config(tmp_path), tiny_model_path).model.state_dict()
    for name, p in resumed.ref_model.state_dict().items():
        assert torch.equal(p, initial[name]), f"{name}: the reference is not the initial model"
    assert resumed.train(_trajectories())["train/kl_ref"] > 1e-6  # the policy kept its distance from it


def test_sft_refuses_the_regularizers(tmp_path):
    with pytest.raises(Exception, match="GSPO/GRPO only"):
        job_config(tmp_path, "algo.name=sft", "algo.kl_coef=0.1", "rollout.n_samples=1")


def test_top_entropy_frac_trains_on_the_selected_tokens_and_1_is_the_default_step(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    def one_step(*overrides):
        learner = make_learner(job_config(tmp_path, *overrides), tiny_model_path)
        stats = learner.train(_trajectories())
        return stats, {n: p.detach().clone() for n, p in learner.model.named_parameters()}

    base, w_base = one_step("algo.kl_coef=0.1")
    full, w_full = one_step("algo.kl_coef=0.1", "algo.top_entropy_frac=1.0")
    top, w_top = one_step("algo.kl_coef=0.1", "algo.top_entropy_frac=0.25")
    assert full["train/selected_token_frac"] == 1.0 and "train/selected_token_frac" not in base
    assert all(torch.equal(w_full[n], w_base[n]) for n in w_base)  # every token selected: the default step
    assert 0.0 < top["train/selected_token_frac"] <= 0.3  # a quarter, ties at the threshold kept
    assert any(not torch.equal(w_top[n], w_base[n]) for n in w_base)  # it trained, on fewer tokens


def _weights(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def test_entropy_target_above_the_entropy_grows_the_bonus_step_by_step_up_to_its_cap(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    # the tiny model's entropy is a few nats: a target of 50 is never reached
    cfg = job_config(tmp_path, "algo.entropy_target=50", "algo.entropy_coef_step=0.5", "algo.entropy_coef_max=1.0")
    learner = make_learner(cfg, tiny_model_path)
    start, before = _entropy_now(learner), _weights(learner)
    first = learner.train(_same_reward(_trajectories()))
    # entropy_coef (0) is the starting coefficient: no bonus yet, no signal, nothing moves
    assert first["train/entropy_coef"] == 0.0 and first["train/active_frac"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    coefs = []
    for _ in range(3):
        stats = learner.train(_same_reward(_trajectories()))
        coefs.append(stats["train/entropy_coef"])
        assert stats["train/active_frac"] == 1.0  # the bonus is on: every sequence has a gradient
    assert coefs == [0.5, 1.0, 1.0]  # a step per call, capped by entropy_coef_max
    assert _entropy_now(learner) > start + 1e-4


def test_entropy_target_below_the_entropy_applies_no_bonus(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.entropy_target=1e-6", "algo.entropy_coef_step=0.5"),
                           tiny_model_path)
    before = _weights(learner)
    for _ in range(3):
        stats = learner.train(_same_reward(_trajectories()))
        assert stats["train/entropy_coef"] == 0.0 and stats["train/active_frac"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())

    # a starting coefficient is applied once; above the target the next call applies none, although coef is not 0
    started = make_learner(job_config(tmp_path, "algo.entropy_target=1e-6", "algo.entropy_coef=0.3",
                                      "algo.entropy_coef_step=0.1", "algo.entropy_coef_max=1.0"), tiny_model_path)
    assert started.train(_same_reward(_trajectories()))["train/entropy_coef"] == 0.3
    assert started._entropy_ctl.coef == pytest.approx(0.2)
    moved = _weights(started)
    stats = started.train(_same_reward(_trajectories()))
    assert stats["train/entropy_coef"] == 0.0 and stats["train/active_frac"] == 0.0
    assert all(torch.equal(p, moved[n]) for n, p in started.model.named_parameters())


def test_without_entropy_target_there_is_no_controller_and_no_coefficient_logged(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.entropy_coef=0.01"), tiny_model_path)
    assert learner._entropy_ctl is None
    assert "train/entropy_coef" not in learner.train(_trajectories())


def test_an_empty_batch_leaves_the_entropy_coefficient_as_it_is(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.entropy_target=50", "algo.entropy_coef_step=0.5",
                                      "algo.entropy_coef_max=1.0"), tiny_model_path)
    learner.train(_same_reward(_trajectories()))  # coef 0.5
    failed = _trajectories()
    for t in failed:
        t.failed = True
    stats = learner.train(failed)
    assert stats["train/num_sequences"] == 0.0 and stats["train/entropy_coef"] == 0.5
    assert (learner._entropy_ctl.coef, learner._entropy_ctl.active) == (0.5, 0.5)


def test_a_resumed_learner_applies_the_adapted_entropy_coefficient(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    cfg = job_config(tmp_path, "algo.entropy_target=50", "algo.entropy_coef_step=0.5", "algo.entropy_coef_max=5.0")
    trained = make_learner(cfg, tiny_model_path)
    for _ in range(2):
        trained.train(_same_reward(_trajectories()))  # coef 0 -> 0.5 -> 1.0
    ckpt = tmp_path / "ckpt"
    trained.save_state(ckpt)
    resumed = make_learner(cfg, str(ckpt))
    resumed.load_state(ckpt)
    assert resumed.train(_same_reward(_trajectories()))["train/entropy_coef"] == 1.0
    assert trained.train(_same_reward(_trajectories()))["train/entropy_coef"] == 1.0

    # a checkpoint without it (older, or from a job without the option) still loads: the coefficient starts over
    from actors.learner import LEARNER_STATE

    state = torch.load(ckpt / LEARNER_STATE, weights_only=False)
    del state["entropy_control"]
    torch.save(state, ckpt / LEARNER_STATE)
    old = make_learner(cfg, str(ckpt))
    old.load_state(ckpt)
    assert old.train(_same_reward(_trajectories()))["train/entropy_coef"] == 0.0


def test_entropy_target_settings_are_checked(tmp_path):
    with pytest.raises(Exception, match="entropy_target: GSPO/GRPO only"):
        job_config(tmp_path, "algo.name=sft", "algo.entropy_target=1.0", "rollout.n_samples=1")
    with pytest.raises(Exception, match="entropy_coef_max.*entropy_coef"):
        job_config(tmp_path, "algo.entropy_target=1.0", "algo.entropy_coef=0.5", "algo.entropy_coef_max=0.2")
    for bad in ("algo.entropy_target=0", "algo.entropy_coef_step=0", "algo.entropy_coef_max=-1"):
        with pytest.raises(Exception, match=bad.split("=")[0].split(".")[1]):
            job_config(tmp_path, bad)
    # without a target the cap is not checked: a fixed entropy_coef above the (unused) default cap is fine
    assert job_config(tmp_path, "algo.entropy_coef=0.5").algo.entropy_target is None


def test_kl_decay_is_kl_coef_until_start_then_linear_to_final_then_flat():
    from rlsys.algos import decayed_kl_coef

    assert [decayed_kl_coef(0.2, None, s) for s in (0, 10_000)] == [0.2, 0.2]
    at = [decayed_kl_coef(0.2, (2, 6, 0.0), s) for s in range(9)]
    assert at == pytest.approx([0.2, 0.2, 0.2, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0])
    assert decayed_kl_coef(0.1, (0, 4, 0.3), 2) == pytest.approx(0.2)  # up is allowed too


def test_the_learner_applies_the_decayed_kl_coefficient_by_its_optimizer_steps_and_after_a_resume(
        tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    cfg = job_config(tmp_path, "algo.kl_coef=0.4", "algo.kl_decay=[1, 3, 0.0]")
    learner = make_learner(cfg, tiny_model_path)
    seen = [learner.train(_trajectories())["train/kl_coef"] for _ in range(3)]  # after 0, 1, 2 optimizer steps
    assert seen == pytest.approx([0.4, 0.4, 0.2])
    ckpt = tmp_path / "ckpt"
    learner.save_state(ckpt)
    resumed = make_learner(cfg, str(ckpt))
    resumed.load_state(ckpt)  # 3 optimizer steps: the schedule's end, 0
    stats = resumed.train(_trajectories())
    assert stats["train/kl_coef"] == 0.0 and stats["train/kl_ref"] > 1e-6  # no penalty at 0, the drift still measured
    # a batch without signal trains nothing at 0 (no regularizer makes its sequences run), as without the option
    assert resumed.train(_same_reward(_trajectories()))["train/active_frac"] == 0.0
    assert "train/kl_coef" not in make_learner(job_config(tmp_path, "algo.kl_coef=0.4"), tiny_model_path).train(
        _trajectories())


def test_kl_decay_settings_are_checked(tmp_path):
    with pytest.raises(Exception, match="kl_decay: decays algo.kl_coef, which is 0"):
        job_config(tmp_path, "algo.kl_decay=[0, 10, 0.0]")
    for bad in ("[10, 10, 0.0]", "[-1, 10, 0.0]", "[0, 10, -0.1]"):
        with pytest.raises(Exception, match="want \\[start, end, final\\]"):
            job_config(tmp_path, "algo.kl_coef=0.2", f"algo.kl_decay={bad}")
    assert job_config(tmp_path, "algo.kl_coef=0.2", "algo.kl_decay=[0, 10, 0.0]").algo.kl_decay == (0, 10, 0.0)


def _two_rank_adapt(rank: int, port: int, entropies: list[float], out) -> None:
    """One of two gloo ranks: `Learner._adapt_entropy_coef` on a stand-in learner, one entropy per call; puts the
    (coef, active) pairs after each call."""
    import types

    import torch.distributed as dist

    from actors.learner import Learner
    from rlsys.algos import EntropyController, RegularizerConfig

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        stub = types.SimpleNamespace(world_size=2, device=torch.device("cpu"), _reg=RegularizerConfig(),
                                     _entropy_ctl=EntropyController(target=0.25, step=0.1, max_coef=1.0))
        seen = []
        for e in entropies:
            Learner._adapt_entropy_coef(stub, e)
            seen.append((round(stub._entropy_ctl.coef, 6), round(stub._reg.entropy_coef, 6)))
        dist.destroy_process_group()
        out.put((rank, seen))
    except Exception as err:  # report it to the test instead of dying silently
        out.put((rank, f"{type(err).__name__}: {err}"))


def test_ranks_adapt_the_entropy_coefficient_on_their_mean_entropy():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # target 0.25. Call 1: 0.1 and 0.5, each rank alone would go opposite ways; the mean 0.3 is above: both 0.
    # Call 2: rank 1 measured nothing (its share of the rows was empty): rank 0's 0.1 alone, below: both up.
    # Call 3: no rank measured anything: no change.
    per_rank = {0: [0.1, 0.1, float("nan")], 1: [0.5, float("nan"), float("nan")]}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_two_rank_adapt, args=(r, port, per_rank[r], out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
    assert got[0] == got[1] == [(0.0, 0.0), (0.1, 0.1), (0.1, 0.1)], got
