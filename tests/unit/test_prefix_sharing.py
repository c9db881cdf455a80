"""Prefix sharing (rlsys/prefix.py): the same per-token logprobs and the same GSPO gradients as the plain forward."""
from __future__ import annotations

import pytest
import torch

from rlsys.algos import GSPOConfig, RegularizerConfig, gspo_loss, regularizer_loss
from rlsys.prefix import (MIN_COMMON_PREFIX, PrefixGroups, common_prefix_length, find_prefix_groups, group_order,
                          plain_token_logprobs, shared_token_logprobs, sharing_supported, tokens_saved)
from rlsys.types import Segment, Trajectory
from tests.conftest import job_config

pytestmark = pytest.mark.timeout(300)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _segments(system: int = 0) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) rows: two prompts shared by 3 and 2 rows, one prompt of its own; answers of different
    lengths, one answer followed by unsampled tokens, one multi-turn row (sampled, tool result, sampled). With
    ``system``, every prompt starts with the same ``system`` tokens (a system prompt and tool schema)."""
    head = _tokens(5, system)
    a, b, c = head + _tokens(1, 30), head + _tokens(2, 22), head + _tokens(3, 17)

    def row(prompt, spans):  # spans: (seed, length, sampled)
        ids, mask = list(prompt), [0] * len(prompt)
        for seed, n, sampled in spans:
            ids += _tokens(seed, n)
            mask += [int(sampled)] * n
        return ids, mask

    return [row(a, [(10, 5, 1)]), row(b, [(11, 9, 1)]), row(a, [(12, 3, 1), (13, 2, 0)]), row(c, [(14, 4, 1)]),
            row(b, [(15, 2, 1)]), row(a, [(16, 4, 1), (17, 6, 0), (18, 3, 1)])]


def _batch(rows):
    T = max(len(ids) for ids, _ in rows)
    ids = torch.zeros((len(rows), T), dtype=torch.long)  # (B, T) right-padded
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros((len(rows), T))
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        attn[i, : len(row_ids)] = 1
        mask[i, : len(row_ids)] = torch.tensor(row_mask, dtype=torch.float32)
    return ids, attn, mask[:, 1:]  # loss mask shifted like the logprobs


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    m.train()  # the learner's mode (dropout is 0 in the tiny model)
    return m


def test_groups_are_rows_with_identical_prompts():
    rows = _segments()
    g = find_prefix_groups([r[0] for r in rows], [r[1] for r in rows])
    assert g.members == [[0, 2, 5], [1, 4]]
    assert g.lengths == [29, 21]  # the prompt minus its last token, whose logits predict the first sampled one
    assert g.rest == [3]
    # no sampled token, a 1-token prompt, a prompt of its own: nothing to share
    assert find_prefix_groups([[1, 2, 3], [4, 5], [6, 7, 8]], [[0, 0, 0], [0, 1], [0, 0, 1]]).rest == [0, 1, 2]
    # prompts in order of first appearance; within one, shorter rows first (b's rows are 31 and 24 tokens long)
    assert group_order([r[0] for r in rows], [r[1] for r in rows]) == [0, 2, 5, 4, 1, 3]


def test_shorter_rows_first_within_a_prompt_pad_less():
    """Eight answers of one prompt, 100 to 1,500 tokens, in micro-batches of 4: as sampled, each micro-batch is as
    long as its longest; sorted, the short answers no longer pad to the long ones."""
    prompt = _tokens(4, 400)
    lengths = [1500, 120, 300, 900, 100, 260, 1400, 180]
    rows = [(prompt + _tokens(20 + i, n), [0] * 400 + [1] * n) for i, n in enumerate(lengths)]

    def padded(order, mbs=4):
        return sum(len(order[i : i + mbs]) * max(len(rows[j][0]) for j in order[i : i + mbs])
                   for i in range(0, len(order), mbs))

    order = group_order([r[0] for r in rows], [r[1] for r in rows])
    assert order == [4, 1, 7, 5, 2, 3, 6, 0]
    assert padded(order) == 4 * 660 + 4 * 1900 < padded(list(range(8))) == 4 * 1900 + 4 * 1800


@pytest.mark.parametrize("system", [0, 40])
def test_shared_logprobs_equal_the_full_forward(model, system):
    rows = _segments(system)
    ids, attn, mask = _batch(rows)
    groups = find_prefix_groups([r[0] for r in rows], [r[1] for r in rows])
    assert sharing_supported(model) is None
    with torch.no_grad():
        plain = plain_token_logprobs(model, ids, attn)  # (B, T-1)
        shared = shared_token_logprobs(model, ids, attn, groups)  # (B, T-1)
    assert shared.shape == plain.shape
    sampled = mask.bool()
    assert torch.allclose(shared[sampled], plain[sampled], atol=1e-5, rtol=0), \
        f"sampled-token logprobs differ by up to {(shared - plain)[sampled].abs().max():.2e}"
    # every position after each row's shared prefix matches too (the tool result of the multi-turn row included)
    after = torch.zeros_like(sampled)
    for rows_g, n in zip(groups.members, groups.lengths):
        for r in rows_g:
            after[r, n : len(rows[r][0]) - 1] = True
    assert torch.allclose(shared[after], plain[after], atol=1e-5, rtol=0)


@pytest.mark.parametrize("system", [0, 40])
def test_gspo_gradients_equal_the_full_forward(model, system):
    rows = _segments(system)
    ids, attn, mask = _batch(rows)
    groups = find_prefix_groups([r[0] for r in rows], [r[1] for r in rows])
    adv = torch.tensor([1.0, -0.5, -1.2, 0.7, 0.5, 0.3])  # (B,)
    with torch.no_grad():  # an old policy a little off the current one, so the ratio is not 1
        old = plain_token_logprobs(model, ids, attn) + 0.01 * torch.randn(ids.shape[0], ids.shape[1] - 1,
                                                                          generator=torch.Generator().manual_seed(0))
    cfg = GSPOConfig(clip_eps_low=0.2, clip_eps_high=0.2)

    def grads(fn):
        model.zero_grad(set_to_none=True)
        loss, _ = gspo_loss(fn(model, ids, attn), old, adv, mask, cfg)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads(lambda m, i, a: plain_token_logprobs(m, i, a))
    shared = grads(lambda m, i, a: shared_token_logprobs(m, i, a, groups))
    model.zero_grad(set_to_none=True)
    for name, g in plain.items():
        assert g.abs().sum() > 0 or name.endswith("bias"), f"{name}: no gradient on the plain path"
        torch.testing.assert_close(shared[name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("system", [0, 40])
def test_shared_entropies_and_their_gradients_equal_the_full_forward(model, system):
    rows = _segments(system)
    ids, attn, mask = _batch(rows)
    groups = find_prefix_groups([r[0] for r in rows], [r[1] for r in rows])
    sampled = mask.bool()
    with torch.no_grad():
        lp_plain, h_plain = plain_token_logprobs(model, ids, attn, entropy="no_grad")  # (B, T-1) each
        lp_shared, h_shared = shared_token_logprobs(model, ids, attn, groups, entropy="no_grad")
    assert torch.equal(lp_plain, plain_token_logprobs(model, ids, attn))
    assert torch.allclose(lp_shared[sampled], lp_plain[sampled], atol=1e-5, rtol=0)
    assert torch.allclose(h_shared[sampled], h_plain[sampled], atol=1e-5, rtol=0), \
        f"sampled-position entropies differ by up to {(h_shared - h_plain)[sampled].abs().max():.2e}"
    assert (h_plain[sampled] > 0).all()

    def grads(fn):  # the gradient of an entropy bonus alone
        model.zero_grad(set_to_none=True)
        _, h = fn(model, ids, attn)
        loss, _ = regularizer_loss(mask, RegularizerConfig(entropy_coef=0.5), entropy=h)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(lambda m, i, a: plain_token_logprobs(m, i, a, entropy="grad"))
    shared = grads(lambda m, i, a: shared_token_logprobs(m, i, a, groups, entropy="grad"))
    model.zero_grad(set_to_none=True)
    assert plain and plain.keys() == shared.keys()
    for name, g in plain.items():
        torch.testing.assert_close(shared[name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_the_groups_common_prefix_runs_once(model):
    """Prompts that begin with the same 40 tokens: those run through the decoder once, not once per group, and
    (the parametrized tests above) the logprobs, entropies and gradients stay the plain forward's."""
    rows = _segments(40)
    ids, attn, _ = _batch(rows)
    groups = find_prefix_groups([r[0] for r in rows], [r[1] for r in rows])
    assert groups.lengths == [69, 61] and groups.common == 40
    prefixes = [rows[m[0]][0][:n] for m, n in zip(groups.members, groups.lengths)]
    assert common_prefix_length(prefixes) == 40
    assert common_prefix_length(prefixes[:1]) == 0  # one group: nothing in common to share
    # a group whose whole prefix is that short keeps one token of it for itself: too little left in common
    assert common_prefix_length([prefixes[0], prefixes[1][:MIN_COMMON_PREFIX]]) == 0
    short = [prefixes[0], list(prefixes[1])]
    short[1][MIN_COMMON_PREFIX - 1] += 1  # the groups part before MIN_COMMON_PREFIX tokens: no pass of its own
    assert common_prefix_length(short) == 0
    assert common_prefix_length([prefixes[0], prefixes[0]]) == 68  # identical: each keeps its last token for itself
    assert find_prefix_groups(*zip(*_segments())).common == 0  # prompts that open differently
    with pytest.raises(ValueError, match="common prefix"):
        PrefixGroups([[0, 1], [2, 3]], [69, 61], [], common=61)
    # train/prefix_saved_frac's count: a prefix for all members but one, the common part for all groups but one
    assert tokens_saved(groups) == 2 * 69 + 1 * 61 + 1 * 40
    assert tokens_saved(find_prefix_groups(*zip(*_segments()))) == 2 * 29 + 1 * 21

    def passes(common: bool) -> tuple[list[tuple[int, int]], torch.Tensor]:  # (rows, tokens) of each decoder pass
        seen = []
        hook = model.base_model.register_forward_pre_hook(
            lambda _, args, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        try:
            with torch.no_grad():
                logp = shared_token_logprobs(model, ids, attn, groups, common=common)
        finally:
            hook.remove()
        return seen, logp

    seen, with_pass = passes(True)
    # the common 40 tokens once, the groups' rests (29 and 21, padded to 29), the suffixes, the lone row
    assert (1, 40) in seen and (2, 29) in seen, seen
    assert not any(shape[1] == 69 for shape in seen), seen
    seen, without = passes(False)  # learner.common_prefix_pass = false: the whole prefixes in one pass, as before
    assert (2, 69) in seen and (1, 40) not in seen, seen
    assert tokens_saved(groups, common=False) == 2 * 69 + 1 * 61
    sampled = _batch(rows)[2].bool()
    assert torch.allclose(with_pass[sampled], without[sampled], atol=1e-5, rtol=0)


@pytest.mark.parametrize("setting,on", [("", True), ("learner.common_prefix_pass=false", False),
                                        ("learner.prefix_sharing=false", False)])
def test_the_learner_runs_the_common_pass_on_cpu_unless_told_not_to(tmp_path, tiny_model_path, setting, on):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, *filter(None, [setting])), tiny_model_path)
    assert learner.device.type == "cpu" and learner.common_prefix_pass is on


def test_no_shared_prompt_falls_back_to_the_full_forward(model):
    rows = [r for i, r in enumerate(_segments()) if i in (0, 1, 3)]  # three different prompts
    ids, attn, _ = _batch(rows)
    groups = find_prefix_groups([r[0] for r in rows], [r[1] for r in rows])
    assert groups == PrefixGroups([], [], [0, 1, 2])
    with torch.no_grad():
        assert torch.equal(shared_token_logprobs(model, ids, attn, groups), plain_token_logprobs(model, ids, attn))


def _trajectories() -> list[Trajectory]:
    """Two boards of 4 samples, interleaved (as an async rollout may return them), and one board of 1 sample."""
    out = []
    for sample in range(4):
        for group, prompt in enumerate((_tokens(1, 30), _tokens(2, 22))):
            answer = _tokens(100 + 10 * group + sample, 3 + sample + group)
            ids = prompt + answer
            seg = Segment(ids, [0] * len(prompt) + [1] * len(answer), [0.0] * len(prompt) + [-1.0] * len(answer))
            reward = [1.0, 0.0, 0.5, -1.0][(sample + group) % 4]
            out.append(Trajectory(item_id=f"b{group}", group=group, sample=sample, segments=[seg], reward=reward,
                                  num_turns=1))
    lone = _tokens(3, 17) + _tokens(200, 4)
    out.append(Trajectory(item_id="b2", group=2, sample=0, segments=[Segment(lone, [0] * 17 + [1] * 4, [0.0] * 21)],
                          reward=1.0, num_turns=1))
    return out


@pytest.mark.parametrize("algo,logp_mode", [("gspo", "bypass"), ("grpo", "bypass"), ("gspo", "decoupled")])
def test_learner_minibatch_gradients_equal_with_and_without_sharing(tmp_path, tiny_model_path, algo, logp_mode):
    """The learner's own path: rows ordered by prompt into micro-batches of 3, so a board's samples are split over
    two and one micro-batch mixes shared and plain rows; in "decoupled" mode logp_old is the learner's recompute,
    shared too."""
    from tests.conftest import make_learner

    grads, stats = {}, {}
    for on in (True, False):
        learner = make_learner(job_config(tmp_path, f"learner.prefix_sharing={str(on).lower()}", f"algo.name={algo}",
                                     f"algo.logp_mode={logp_mode}", mini_bs="3", batch_size="3", n_samples="3"),
                          tiny_model_path)
        assert learner.prefix_sharing is on
        rows, _ = learner._policy_rows(_trajectories())
        learner._last_trained = []
        learner._tokens = [0, 0]
        logp_old = learner._recompute_old_logprobs(rows) if logp_mode == "decoupled" else None
        stats[on] = learner._minibatch(rows, logp_old, first=True)
        grads[on] = {n: p.grad.clone() for n, p in learner.model.named_parameters()}
        if on:
            # micro-batches [a a a] [a b b] [b b] (+ the lone board in the recompute): 2 x 29 + 1 x 21 + 1 x 21
            saved = 100 * (2 if logp_mode == "decoupled" else 1)  # the recompute shares as well
            assert learner._tokens[0] == saved, "the two 4-sample boards did not share their prompts"
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # The loss and the grad norm are sums over the whole minibatch; the other metrics are means of micro-batch
    # means, which depend on how rows fall into micro-batches (sharing orders them by prompt).
    for key in ("train/loss", "train/grad_norm"):
        assert stats[True][key] == pytest.approx(stats[False][key], rel=1e-4, abs=1e-6), key


def test_the_length_order_changes_the_micro_batches_not_the_gradient(tmp_path, tiny_model_path):
    """`learner.length_order`: a prompt's rows shorter first (less padding), the same gradient as in sampled order."""
    from tests.conftest import make_learner

    grads, padded = {}, {}
    for on in (True, False):
        learner = make_learner(job_config(tmp_path, f"learner.length_order={str(on).lower()}", "algo.name=gspo",
                                          mini_bs="2", batch_size="3", n_samples="4"), tiny_model_path)
        trajs = _trajectories()  # samples 0-3 of boards 0 and 1 interleaved, answers 3-6 and 4-7 tokens, and a lone one
        rows, _ = learner._policy_rows([trajs[2 * s + g] for s in (0, 3, 1, 2) for g in (0, 1)] + trajs[8:])
        learner._last_trained = []
        learner._minibatch(rows, None, first=True)  # sampled order: 3, 6, 4, 5; the gradient before the step
        padded[on] = learner._padding[0]
        grads[on] = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    assert grads[False], "no gradient: the rows had no advantage"
    assert padded[True] < padded[False]  # micro-batches of 2: (3, 4) (5, 6) pad 2 positions a board, (3, 6) (4, 5) 4
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_sharing_is_off_under_gradient_checkpointing(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "model.gradient_checkpointing=true", "algo.name=gspo"), tiny_model_path)
    assert not learner.prefix_sharing
    assert "checkpointing" in sharing_supported(learner.model)


@pytest.mark.parametrize("path", ["plain", "shared"])
def test_logprobs_keep_no_float32_copy_of_bf16_logits_for_backward(model, path):
    """The learner's logprobs (and the entropy bonus) read the model's logits in float32 chunks: what autograd keeps
    for backward at the logits' size is the bf16 logits themselves, never a (B, T, V) float32 copy (the 5 GiB
    allocation that ran a gsm job out of GPU memory), and the values equal log_softmax over the float32 logits."""
    rows = _segments()
    ids, attn, mask = _batch(rows)
    groups = find_prefix_groups([r[0] for r in rows], [r[1] for r in rows])
    bf16 = type(model)(model.config).to(torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    vocab = model.config.vocab_size
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[-1] == vocab and t.numel() >= ids.shape[0] * vocab:  # logits-sized
            saved.append(t)
        return t

    fn = (lambda: plain_token_logprobs(bf16, ids, attn, entropy="grad")) if path == "plain" else \
        (lambda: shared_token_logprobs(bf16, ids, attn, groups, entropy="grad"))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logp, entropy = fn()  # (B, T-1) each
    assert saved, "no logits-sized tensor was saved for backward: the hook saw nothing to check"
    assert all(t.dtype == torch.bfloat16 for t in saved), \
        f"float32 copies of the logits kept for backward: {[(t.dtype, tuple(t.shape)) for t in saved]}"
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32

    with torch.no_grad():  # the reference: log_softmax of the float32 logits of the same bf16 model
        ref = torch.log_softmax(bf16(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)
        ref = ref.gather(-1, ids[:, 1:, None]).squeeze(-1)
    sampled = mask.bool()
    # bf16 arithmetic: the shared path runs the answers on a bf16 KV cache (measured 0.004 here), the plain one does not
    torch.testing.assert_close(logp[sampled].detach(), ref[sampled], rtol=0, atol=1e-2 if path == "shared" else 1e-5)
    (logp[sampled].sum() + entropy[sampled].sum()).backward()  # the graph runs back through the chunked functions
    assert bf16.lm_head.weight.grad is not None and bf16.lm_head.weight.grad.abs().sum() > 0


def test_a_token_budget_cuts_fewer_micro_batches_with_the_same_gradient(tmp_path, tiny_model_path):
    """`learner.micro_batch_tokens`: micro-batches sized by padded positions instead of rows; the loss normaliser is
    the minibatch's, so the gradient is the one of `mini_bs` micro-batches; fewer forwards (`train/micro_batches`)."""
    from tests.conftest import make_learner

    grads, counts = {}, {}
    for name, flags in (("rows", []), ("tokens", ["learner.micro_batch_tokens=120"])):
        learner = make_learner(job_config(tmp_path, "algo.name=gspo", *flags, mini_bs="2", batch_size="3",
                                          n_samples="4"), tiny_model_path)
        rows, _ = learner._policy_rows(_trajectories())  # 8 rows of 33-37 tokens and 26-29, one of 21: 3 x 37 <= 120
        learner._last_trained = []
        learner._minibatch(rows, None, first=True)  # the gradient before the optimizer step
        counts[name] = learner._micro
        grads[name] = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    assert counts["tokens"] < counts["rows"], counts
    assert grads["rows"], "no gradient: the rows had no advantage"
    for name, g in grads["rows"].items():
        torch.testing.assert_close(grads["tokens"][name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
