"""token_entropy, kl_k3 and regularizer_loss (entropy bonus, k3 KL to a reference) against hand-computed values."""
import math

import pytest
import torch

from rlsys.algos import RegularizerConfig, kl_k3, regularizer_loss, token_entropy


def test_entropy_of_uniform_and_one_hot_rows():
    # uniform over 4: ln 4; (almost) one-hot: ~0; two equal logits and two at -inf-ish: ln 2
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [5.0, 5.0, -200.0, -200.0]]])  # (1, 3, 4)
    h = token_entropy(logits)  # (1, 3)
    assert h.shape == (1, 3)
    assert h[0, 0].item() == pytest.approx(math.log(4))
    assert h[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    assert h[0, 2].item() == pytest.approx(math.log(2))


def test_entropy_matches_dense_formula_and_its_gradient_in_chunks():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)  # (B, T, V)
    dense = -(torch.softmax(logits / 0.7, -1) * torch.log_softmax(logits / 0.7, -1)).sum(-1)  # (B, T)
    chunked = token_entropy(logits, temperature=0.7, chunk_rows=3)  # 10 rows in chunks of 3
    assert torch.allclose(chunked, dense)
    w = torch.randn(2, 5, dtype=torch.float64)
    (g_dense,) = torch.autograd.grad((dense * w).sum(), logits)
    (g_chunk,) = torch.autograd.grad((token_entropy(logits, temperature=0.7, chunk_rows=3) * w).sum(), logits)
    assert torch.allclose(g_chunk, g_dense)


def test_entropy_of_bf16_logits_is_float32():
    assert token_entropy(torch.zeros(1, 2, 8, dtype=torch.bfloat16)).dtype == torch.float32


def test_k3_by_hand():
    # d = ref - new: 0 -> 0; ln 2 -> 2 - ln 2 - 1; -ln 2 -> 0.5 + ln 2 - 1
    new = torch.zeros(1, 3)
    ref = torch.tensor([[0.0, math.log(2), -math.log(2)]])
    k3 = kl_k3(new, ref)
    assert k3.tolist()[0] == pytest.approx([0.0, 1 - math.log(2), math.log(2) - 0.5])
    assert (k3 >= 0).all()


def test_k3_is_clamped_finite():
    assert torch.isfinite(kl_k3(torch.tensor([[-1000.0]]), torch.tensor([[0.0]]))).all()


def test_regularizer_loss_value_gradient_and_metrics():
    # mask keeps 3 of 4 tokens; entropies 1, 2, 3 (masked-out 100); k3 values 0, 1 - ln 2, 0 (masked-out huge)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)  # (2, 3)
    entropy = torch.tensor([[1.0, 2.0, 100.0], [3.0, 9.0, 9.0]], requires_grad=True)
    new = torch.zeros(2, 3, requires_grad=True)
    ref = torch.tensor([[0.0, math.log(2), 20.0], [0.0, 20.0, 20.0]])
    cfg = RegularizerConfig(entropy_coef=0.1, kl_coef=0.5)
    loss, m = regularizer_loss(mask, cfg, entropy=entropy, logp_new=new, logp_ref=ref, normalizer=6.0)
    kl_sum = 1 - math.log(2)
    assert loss.item() == pytest.approx((0.5 * kl_sum - 0.1 * 6.0) / 6.0)
    assert m["train/entropy"] == pytest.approx(2.0)  # micro-batch token mean, whatever the normalizer
    assert m["train/kl_ref"] == pytest.approx(kl_sum / 3)
    loss.backward()
    assert torch.allclose(entropy.grad, torch.tensor([[-0.1 / 6, -0.1 / 6, 0.0], [-0.1 / 6, 0.0, 0.0]]))
    # d k3 / d new = -(exp(d) - 1) = 1 - exp(ref - new): 0 and -1 on the kept tokens, times 0.5 / 6
    assert torch.allclose(new.grad, torch.tensor([[0.0, -0.5 / 6, 0.0], [0.0, 0.0, 0.0]]))


def test_zero_coefficients_add_nothing_but_still_measure():
    mask = torch.ones(1, 2)
    entropy = torch.tensor([[1.0, 3.0]], requires_grad=True)
    loss, m = regularizer_loss(mask, RegularizerConfig(), entropy=entropy)
    assert loss.item() == 0.0 and not loss.requires_grad
    assert m == {"train/entropy": 2.0}


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="coefficients"):
        RegularizerConfig(entropy_coef=-1.0)
    with pytest.raises(ValueError, match="must match"):
        regularizer_loss(torch.ones(2, 3), entropy=torch.ones(2, 2))
    with pytest.raises(ValueError, match="needs logp_new"):
        regularizer_loss(torch.ones(1, 1), logp_ref=torch.zeros(1, 1))


def test_top_entropy_mask_keeps_the_top_share_of_sampled_tokens_only():
    from rlsys.algos import top_entropy_mask

    # 2 rows x 6 positions; position 0 is the prompt (not sampled) and has the largest entropy of all
    entropy = torch.tensor([[9.0, 0.1, 0.2, 2.0, 0.3, 0.1],
                            [9.0, 0.2, 1.5, 0.1, 0.1, 0.4]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])  # 9 sampled tokens
    top = top_entropy_mask(mask, entropy, 0.25)
    # the 0.75 quantile of the 9 sampled entropies is 0.3: 2.0, 1.5, 0.3 at or above it; never the prompt, never
    # row 1's unsampled 0.4
    assert top.tolist() == [[False, False, False, True, True, False], [False, False, True, False, False, False]]
    assert not bool((top & ~mask.bool()).any())
    assert top_entropy_mask(mask, entropy, 1.0).tolist() == mask.bool().tolist()
    assert not bool(top_entropy_mask(torch.zeros_like(mask), entropy, 0.5).any())
    with pytest.raises(ValueError, match="frac"):
        top_entropy_mask(mask, entropy, 0.0)
    with pytest.raises(ValueError, match="must match"):
        top_entropy_mask(mask, entropy[:, :5], 0.5)


def test_top_entropy_frac_is_a_policy_loss_option():
    from pydantic import ValidationError

    from rlsys.config import load_config

    assert load_config(None, overrides=["algo.top_entropy_frac=0.1"]).algo.top_entropy_frac == 0.1
    with pytest.raises((ValidationError, ValueError), match="top_entropy_frac"):
        load_config(None, overrides=["algo.name=sft", "algo.top_entropy_frac=0.1"])
    with pytest.raises((ValidationError, ValueError), match="top_entropy_frac"):
        load_config(None, overrides=["algo.top_entropy_frac=1.5"])


def test_entropy_controller_follows_skywork_or1s_rule():
    from rlsys.algos import EntropyController

    ctl = EntropyController(target=1.0, step=0.3, max_coef=0.7, coef=0.1, active=0.1)
    ctl.update(0.5)  # below the target: up by a step, and applied
    assert (ctl.coef, ctl.active) == pytest.approx((0.4, 0.4))
    ctl.update(0.5)
    ctl.update(0.5)  # 0.7, then the cap
    assert (ctl.coef, ctl.active) == pytest.approx((0.7, 0.7))
    ctl.update(1.0)  # at the target counts as above: down a step, and no bonus at all while above
    assert (ctl.coef, ctl.active) == pytest.approx((0.4, 0.0))
    ctl.update(2.0)
    ctl.update(2.0)  # 0.1, then clamped at 0
    assert (ctl.coef, ctl.active) == (0.0, 0.0)
    ctl.update(0.9)  # back below: the bonus returns from where coef stood
    assert (ctl.coef, ctl.active) == pytest.approx((0.3, 0.3))
    for broken in (float("nan"), float("inf"), float("-inf")):  # no entropy measured: nothing moves
        ctl.update(broken)
        assert (ctl.coef, ctl.active) == pytest.approx((0.3, 0.3))


def test_entropy_controller_state_round_trips_as_plain_floats():
    from rlsys.algos import EntropyController

    ctl = EntropyController(target=1.0, step=0.25, max_coef=1.0)
    ctl.update(0.5)
    ctl.update(0.5)
    ctl.update(3.0)  # coef 0.25, active 0
    state = ctl.state_dict()
    assert state == {"coef": 0.25, "active": 0.0} and all(type(v) is float for v in state.values())
    other = EntropyController(target=1.0, step=0.25, max_coef=1.0)
    other.load_state_dict(state)
    assert (other.coef, other.active) == (0.25, 0.0)
    other.update(0.5)  # and it goes on as the original does
    ctl.update(0.5)
    assert (other.coef, other.active) == (ctl.coef, ctl.active) == (0.5, 0.5)
    lower_cap = EntropyController(target=1.0, step=0.25, max_coef=0.3)  # a resume that lowered the cap
    lower_cap.load_state_dict({"coef": 0.75, "active": 0.75})
    assert (lower_cap.coef, lower_cap.active) == (0.3, 0.3)


def test_entropy_controller_refuses_bad_settings():
    from rlsys.algos import EntropyController

    with pytest.raises(ValueError, match="must be > 0"):
        EntropyController(target=0.0, step=0.1, max_coef=1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        EntropyController(target=1.0, step=0.0, max_coef=1.0)
    with pytest.raises(ValueError, match="max_coef"):
        EntropyController(target=1.0, step=0.1, max_coef=0.1, coef=0.2, active=0.2)
