"""sft_loss, and the token_logprobs / masked_mean helpers it and the RL losses build on."""
import math

import pytest
import torch
import torch.nn.functional as F

from rlsys.algos import masked_mean, sft_loss, token_logprobs

# --- token_logprobs ---------------------------------------------------------------------------


def _reference_logprobs(logits, targets, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)


def test_token_logprobs_by_hand():
    # row [0, ln 3]: softmax = (1/4, 3/4); row [2, 2, 2] would be uniform, here V = 2
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]])
    got = token_logprobs(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(got, torch.tensor([[math.log(0.75), math.log(0.5)]]))


@pytest.mark.parametrize("chunk_rows", [None, 1, 4])  # 4 does not divide B*T = 6: a short last chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_log_softmax_gather_value_and_grad(chunk_rows, temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 3, 11)).requires_grad_(True)
    targets = torch.randint(0, 11, (2, 3))
    weights = torch.randn(2, 3)
    got = token_logprobs(logits, targets, temperature, chunk_rows=chunk_rows)
    want = _reference_logprobs(logits, targets, temperature)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
    torch.testing.assert_close(g_got, g_want)


def test_token_logprobs_gradcheck_float64():
    torch.manual_seed(0)
    logits = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 3], [2, 2]])
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 1.3, chunk_rows=3), (logits,))


def test_token_logprobs_bfloat16_computes_in_float32():
    torch.manual_seed(0)
    logits = (4 * torch.randn(2, 3, 50)).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 50, (2, 3))
    got = token_logprobs(logits, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference_logprobs(logits, targets))
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_token_logprobs_rejects_unshifted_shapes():
    with pytest.raises(ValueError, match="target_ids"):
        token_logprobs(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))


# --- masked_mean ------------------------------------------------------------------------------


def test_masked_mean_ignores_masked_values_even_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert float(masked_mean(x, mask).detach()) == pytest.approx((1 + 2 + 4 + 6) / 4)
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 5.0]))
    masked_mean(x, mask).backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.25, 0.25, 0.0], [0.25, 0.0, 0.25]]))


def test_masked_mean_of_nothing_is_zero():
    x = torch.tensor([[3.0, 4.0], [5.0, 6.0]])
    mask = torch.tensor([[0, 0], [1, 0]])
    assert float(masked_mean(x, torch.zeros_like(mask))) == 0.0
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([0.0, 5.0]))


# --- sft_loss ---------------------------------------------------------------------------------


def test_sft_loss_by_hand():
    # V = 4. Token (0,0): uniform logits -> NLL ln 4, argmax (first max, id 0) != target 2.
    # Token (0,1): logits [0, ln 3, 0, 0] -> p(target 1) = 3/6 -> NLL ln 2, argmax correct.
    # Token (0,2) is masked: its huge wrong logit changes nothing.
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), 0.0, 0.0], [99.0, 0.0, 0.0, 0.0]]]
    )
    targets = torch.tensor([[2, 1, 3]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = sft_loss(logits, targets, mask)
    assert float(loss.detach()) == pytest.approx((math.log(4) + math.log(2)) / 2)
    assert m["train/loss"] == pytest.approx(float(loss.detach()))
    assert m["train/sft_token_acc"] == 0.5
    assert m["train/num_tokens"] == 2.0


def test_sft_loss_matches_cross_entropy_on_masked_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3))
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    loss, _ = sft_loss(logits, targets, mask)
    want = F.cross_entropy(logits[mask], targets[mask])  # mean over the 4 masked tokens
    torch.testing.assert_close(loss, want)
    (g_got,) = torch.autograd.grad(loss, logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want)
    assert g_got[~mask].abs().max() == 0.0


def test_sft_gradient_accumulation_with_normalizer_equals_one_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (3, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    full, _ = sft_loss(logits, targets, mask)
    summed = sum(
        sft_loss(logits[p], targets[p], mask[p], normalizer=7.0)[0] for p in (slice(0, 1), slice(1, 3))
    )
    torch.testing.assert_close(summed, full)
    (g_sum,) = torch.autograd.grad(summed, logits)
    (g_full,) = torch.autograd.grad(full, logits)
    torch.testing.assert_close(g_sum, g_full)
