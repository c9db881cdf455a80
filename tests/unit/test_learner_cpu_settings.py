"""actors/learner_setup.py `cpu_process_settings`: a CPU learner's attention runs GQA natively (no repeated key/value
heads) with the same logits and gradients, and a user's own setting of the switch wins."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations import sdpa_attention

from actors.learner_setup import cpu_process_settings

SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def gqa_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).float()


def forward_backward(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits.logsumexp(-1) * mask).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_native_gqa_same_logits_and_gradients_without_repeating_heads(monkeypatch):
    model = gqa_model()
    ids = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 24, dtype=torch.long)
    mask[:2, 17:] = 0  # padding: the forward has a mask, where transformers repeats the heads unless told otherwise
    repeats = []
    real_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: repeats.append(n) or real_repeat(x, n))

    monkeypatch.setenv(SWITCH, "0")
    logits, grads = forward_backward(model, ids, mask)
    assert repeats  # the default path repeats the 2 key/value heads to all 8
    repeats.clear()
    monkeypatch.delenv(SWITCH)
    cpu_process_settings(torch.device("cpu"))
    native_logits, native_grads = forward_backward(model, ids, mask)
    assert repeats == []  # the switch took effect (a transformers upgrade that renames it fails here)
    torch.testing.assert_close(native_logits, logits, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(native_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("device, preset, expected", [("cpu", None, "1"), ("cpu", "0", "0"), ("meta", None, None)])
def test_switch_set_on_cpu_only_and_a_users_value_wins(monkeypatch, device, preset, expected):
    monkeypatch.delenv(SWITCH, raising=False)
    if preset is not None:
        monkeypatch.setenv(SWITCH, preset)
    cpu_process_settings(torch.device(device))
    import os

    assert os.environ.get(SWITCH) == expected
