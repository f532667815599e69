"""Off-policy losses: expected-gradient identities under a logging ESR by exact enumeration,
weight capping and self-normalisation, numerics, input checks."""

import functools
import math

import pytest
import torch

from capg_rec import (CAPGLoss, DenseCatalog, EmbeddingCatalog, OffPolicyCAPGLoss, OffPolicyVPGLoss,
                      TopKReinforceLoss, candidate_log_prob, expert_of_position, inclusion_log_prob, sample_candidates)
from capg_rec import functional as F
from capg_rec._enumerate import all_draws, draw_log_probs, inclusion_probs


def _problem(n, k, m, length, seed):
    """Every ordered draw of a tiny problem, with the target ESR's logits (leaf), the logging ESR's
    logits, fixed item qualities (the LSR shows the ``length`` candidates of largest quality, so
    what is shown depends on the whole set) and per-item mean rewards."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(1, m, n, generator=g, dtype=torch.float64).requires_grad_()
    logging = torch.randn(1, m, n, generator=g, dtype=torch.float64)
    quality = torch.randn(n, generator=g, dtype=torch.float64)
    mean_reward = 1.0 + torch.rand(n, generator=g, dtype=torch.float64)
    draws = all_draws(n, k)
    picks = quality[draws].topk(length, dim=1).indices
    chosen = draws.gather(1, picks)  # [S, L]
    return theta, logging, mean_reward, draws, chosen


def _shown_given_included(logging, draws, chosen, experts):
    """ρ₀(a) = P_{A~π₀}(LSR shows a | a ∈ A) → [N], and the draw probabilities p₀ [S]."""
    n = logging.shape[2]
    p0 = draw_log_probs(logging, draws, experts)[0].exp()
    shown = torch.zeros(n, dtype=torch.float64).index_add_(0, chosen.reshape(-1),
                                                           p0.repeat_interleave(chosen.shape[1]))
    incl0 = inclusion_probs(logging, experts)[0]
    return shown / incl0, p0, incl0


CASES = [(5, 2, 1, 1), (5, 3, 1, 2), (6, 3, 2, 2), (7, 2, 2, 1), (4, 3, 2, 2), (6, 3, 1, 1)]


@pytest.mark.parametrize(("n", "k", "m", "length"), CASES)
def test_offpolicy_capg_expected_gradient_is_the_lemma_under_the_logging_esr(n, k, m, length):
    """E_{π₀}[∇ off-policy CA-PG] = -Σ_a r̄(a) ρ₀(a) ∇π_θ(a ∈ A^K), exactly (enumerated inclusion)."""
    theta, logging, rbar, draws, chosen = _problem(n, k, m, length, seed=10 * n + k + m + length)
    experts = expert_of_position(k, m)
    rho0, p0, incl0 = _shown_given_included(logging, draws, chosen, experts)
    incl = inclusion_probs(theta, experts)[0]  # differentiable in θ
    (expected,) = torch.autograd.grad((rbar * rho0 * incl).sum(), theta)
    logged = incl0.log()[chosen]
    loss = F.offpolicy_capg_loss(theta.expand(len(draws), -1, -1), draws, chosen, rbar[chosen], logged,
                                 method="enumerate", reduction="none")
    (grad,) = torch.autograd.grad((p0 * loss).sum(), theta)
    torch.testing.assert_close(grad, -expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("n", "k", "m", "length"), CASES)
def test_offpolicy_capg_with_the_target_as_logger_is_on_policy_capg(n, k, m, length):
    """π₀ = π_θ: the weights are 1 and the loss is on-policy CA-PG's, row by row."""
    theta, _, rbar, draws, chosen = _problem(n, k, m, length, seed=n + k)
    experts = expert_of_position(k, m)
    logits = theta.expand(len(draws), -1, -1)
    logged = inclusion_probs(theta.detach(), experts)[0].log()[chosen]
    off = F.offpolicy_capg_loss(logits, draws, chosen, rbar[chosen], logged, method="enumerate", reduction="none")
    on = CAPGLoss(k, method="enumerate", reduction="none")(logits, draws, chosen, rbar[chosen])
    torch.testing.assert_close(off, on, rtol=1e-12, atol=1e-12)
    p = draw_log_probs(theta.detach(), draws, experts)[0].exp()
    g_off, = torch.autograd.grad((p * off).sum(), theta)
    g_on, = torch.autograd.grad((p * on).sum(), theta)
    torch.testing.assert_close(g_off, g_on, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("n", "k", "m", "length"), CASES)
def test_offpolicy_capg_swr_expected_gradient_uses_expected_counts(n, k, m, length):
    """method="with_replacement": E_{π₀}[∇] = -Σ_a r̄(a) (P₀(a shown) / c₀(a)) ∇c_θ(a), with the
    expected counts c(a) = Σ_k softmax_{m(k)}(a) logged on both sides."""
    theta, logging, rbar, draws, chosen = _problem(n, k, m, length, seed=3 * n + k)
    experts = expert_of_position(k, m)
    _, p0, _ = _shown_given_included(logging, draws, chosen, experts)
    shown = torch.zeros(n, dtype=torch.float64).index_add_(0, chosen.reshape(-1), p0.repeat_interleave(length))
    everything = torch.arange(n).unsqueeze(0)
    count0 = inclusion_log_prob(logging, everything, k, method="with_replacement")[0].exp()
    count = inclusion_log_prob(theta, everything, k, method="with_replacement")[0].exp()
    (expected,) = torch.autograd.grad((rbar * shown / count0 * count).sum(), theta)
    loss = OffPolicyCAPGLoss(k, method="with_replacement", reduction="none")(
        theta.expand(len(draws), -1, -1), draws, chosen, rbar[chosen], count0.log()[chosen])
    (grad,) = torch.autograd.grad((p0 * loss).sum(), theta)
    torch.testing.assert_close(grad, -expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("n", "k", "m", "length"), CASES)
def test_offpolicy_vpg_expected_gradient_is_the_policy_gradient(n, k, m, length):
    """E_{π₀}[∇ whole-set IPS V-PG] = -∇ E_{π_θ}[Σ_l r_l], exactly."""
    theta, logging, rbar, draws, chosen = _problem(n, k, m, length, seed=7 * n + k + m)
    experts = expert_of_position(k, m)
    log_p0 = draw_log_probs(logging, draws, experts)[0]
    value = (draw_log_probs(theta, draws, experts)[0].exp() * rbar[chosen].sum(1)).sum()
    (expected,) = torch.autograd.grad(value, theta)
    loss = OffPolicyVPGLoss(k, reduction="none")(theta.expand(len(draws), -1, -1), draws, chosen, rbar[chosen],
                                                 log_p0)
    (grad,) = torch.autograd.grad((log_p0.exp() * loss).sum(), theta)
    torch.testing.assert_close(grad, -expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("m", [1, 2])
def test_topk_reinforce_is_chens_corrected_reinforce(m):
    """Per shown item: -(π/β)·K(1-π)^{K-1}·r·log π, π the single-draw probability (for M > 1 the
    mean over positions of softmax_{m(k)}), β the logged one; weights constant."""
    g = torch.Generator().manual_seed(m)
    n, k, b = 7, 3, 4
    logits = torch.randn(b, m, n, generator=g, dtype=torch.float64).requires_grad_()
    candidates = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
    chosen = candidates[:, :2]
    rewards = torch.rand(b, 2, generator=g, dtype=torch.float64)
    beta = torch.rand(b, 2, generator=g, dtype=torch.float64) * 0.5 + 0.05
    experts = expert_of_position(k, m)
    pi = torch.softmax(logits, dim=2)[:, experts].mean(1).gather(1, chosen)  # [B, L]
    lam = k * (1 - pi.detach()) ** (k - 1)
    reference = -((pi.detach() / beta) * lam * rewards * pi.log()).sum(1)
    loss = TopKReinforceLoss(k, reduction="none")(logits, candidates, chosen, rewards, beta.log())
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)
    g_loss, = torch.autograd.grad(loss.sum(), logits)
    g_ref, = torch.autograd.grad(reference.sum(), logits)
    torch.testing.assert_close(g_loss, g_ref, rtol=1e-12, atol=1e-12)
    capped = TopKReinforceLoss(k, reduction="none", max_weight=1.5)(logits, candidates, chosen, rewards, beta.log())
    torch.testing.assert_close(capped, -((pi / beta).detach().clamp(max=1.5) * lam * rewards * pi.log()).sum(1))


def _logged_rows(seed, b=6, n=8, k=3, length=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n, generator=g, dtype=dtype).requires_grad_()
    logging = torch.randn(b, n, generator=g, dtype=dtype)
    candidates = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
    chosen = candidates[:, :length]
    rewards = torch.rand(b, length, generator=g, dtype=dtype)
    logged = inclusion_log_prob(logging, chosen, k, method="exact")
    return logits, candidates, chosen, rewards, logged


def test_capping_and_self_normalisation_are_as_documented():
    logits, candidates, chosen, rewards, logged = _logged_rows(0)
    k, length = candidates.shape[1], chosen.shape[1]
    score = inclusion_log_prob(logits, chosen, k, method="mean_field")
    ratio = (score - logged).exp().detach()
    plain = OffPolicyCAPGLoss(k, reduction="none")(logits, candidates, chosen, rewards, logged)
    torch.testing.assert_close(plain, -(ratio * rewards * score).sum(1))
    cap = float(ratio.median())
    capped = OffPolicyCAPGLoss(k, max_weight=cap, reduction="none")(logits, candidates, chosen, rewards, logged)
    torch.testing.assert_close(capped, -(ratio.clamp(max=cap) * rewards * score).sum(1))
    snips = OffPolicyCAPGLoss(k, max_weight=cap, self_normalize=True)(logits, candidates, chosen, rewards, logged)
    w = ratio.clamp(max=cap)
    torch.testing.assert_close(snips, -length * (w * rewards * score).sum() / w.sum())
    normalised = F.importance_weights(score - logged, max_weight=cap, self_normalize=True)
    torch.testing.assert_close(normalised.mean(), torch.tensor(1.0, dtype=torch.float64))
    assert F.importance_weights(torch.full((3,), -math.inf), self_normalize=True).eq(0).all()  # zeros stay zero
    # zeros stay zero in float16 beside a weight of more than float16's largest value over its mean (found by
    # review: the normaliser, cast to float16 first, was inf, and 0 × inf NaN)
    many = torch.full((70_000,), -30.0, dtype=torch.float16)
    many[0], many[1] = 0.0, -math.inf
    w = F.importance_weights(many, self_normalize=True)
    assert not w.isnan().any() and w[1] == 0 and w[2] == 0 and w[0] == w.max() > 100
    vpg = OffPolicyVPGLoss(k, self_normalize=True, reduction="sum")(logits, candidates, chosen, rewards,
                                                                    logged.sum(1))
    set_score = candidate_log_prob(logits, candidates)
    w_set = (set_score - logged.sum(1)).exp().detach()
    torch.testing.assert_close(vpg, -(w_set / w_set.mean() * rewards.sum(1) * set_score).sum())


@pytest.mark.parametrize("loss_cls", [OffPolicyCAPGLoss, OffPolicyVPGLoss, TopKReinforceLoss])
def test_weights_never_overflow_at_huge_logit_gaps(loss_cls, device):
    """float32, logit gaps of 1e4 between target and logging ESR: finite loss and gradient, the
    weights capped at sqrt(float32 max) or at 0."""
    k = 2
    logits = torch.tensor([[0.0, -1e4, -2e4, 0.0, -1e4, -3e4]] * 2, device=device).requires_grad_()
    candidates = torch.tensor([[0, 1], [4, 5]], device=device)
    chosen = candidates[:, :1]
    rewards = torch.ones(2, 1, device=device)
    per_item = torch.tensor([[-1e4], [-0.01]], device=device)  # item 0: θ sure, π₀ not; item 4: reverse
    logged = per_item.sum(1) if loss_cls is OffPolicyVPGLoss else per_item
    loss = loss_cls(k)(logits, candidates, chosen, rewards, logged)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    w = F.importance_weights(torch.tensor([1e4, -1e4, 80.0]))
    torch.testing.assert_close(w[0], torch.tensor(math.sqrt(torch.finfo(torch.float32).max)), rtol=2e-5, atol=0)
    assert w[1] == 0 and torch.isfinite(w).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_default_cap_keeps_a_weight_s_square_finite(dtype):
    """The default cap, half the log of the dtype's largest value, exponentiated to a weight above sqrt(max) in
    float16, float32 and float64, whose square overflowed."""
    w = F.importance_weights(torch.tensor([1e4], dtype=dtype))
    assert torch.isfinite(w * w).all() and w.item() > 0.69 * math.sqrt(torch.finfo(dtype).max)


@pytest.mark.parametrize("loss_cls", [OffPolicyCAPGLoss, OffPolicyVPGLoss, TopKReinforceLoss])
@pytest.mark.parametrize("catalog", ["logits", "embeddings"])
def test_half_precision_inputs_get_finite_gradients_from_huge_weights(loss_cls, catalog, device):
    """float16 logits (or embeddings) are scored in float32, but their gradients come back in float16: the default
    cap followed float32 (sqrt: 1.8e19), and an explored item (logged at ~1e-6) that the new ESR likes gave a
    weight of ~1e5 and inf gradients. The cap now follows the narrower dtype: below sqrt(65504)."""
    gen = torch.Generator().manual_seed(0)
    b, n, k, length = 2, 64, 4, 2
    user = torch.randn(b, 8, generator=gen)
    item = torch.randn(n, 8, generator=gen)
    item[:k] += 3.0 * user.mean(0)  # the new ESR likes items 0..3
    candidates = torch.arange(k).expand(b, k).clone().to(device)
    chosen, rewards = candidates[:, :length], torch.full((b, length), 10.0, device=device)
    per_item = torch.full((b, length), -14.0, device=device)  # pi0(a in A) ~ 1e-6
    logged = per_item.sum(1) * 10 if loss_cls is OffPolicyVPGLoss else per_item
    grads = {}
    for dtype in (torch.float16, torch.float32):
        if catalog == "embeddings":
            leaves = [t.to(device, dtype).requires_grad_() for t in (user, item)]
            scores = EmbeddingCatalog(*leaves)
        else:
            leaves = [(user @ item.T).to(device, dtype).requires_grad_()]
            scores = leaves[0]
        loss = loss_cls(k)(scores, candidates, chosen, rewards, logged)
        loss.backward()
        grads[dtype] = [leaf.grad for leaf in leaves]
    assert all(torch.isfinite(g).all() for g in grads[torch.float16])
    assert max(g.abs().max() for g in grads[torch.float32]) > 65504  # float32's own cap: beyond float16's range


@pytest.mark.parametrize("placement", ["embedding", "sampled", "sharded"])
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                    (torch.float16, torch.float32)])
def test_half_precision_embeddings_of_other_catalogs_get_finite_gradients(placement, dtypes):
    """Found by review: the cap followed float16 on the dense and embedding catalogs only; a SampledCatalog or a
    ShardedEmbeddingCatalog of float16 embeddings still returned inf gradients. Users and items of different dtypes
    (scored in the wider) cap for the narrower, whichever side it is."""
    from capg_rec.sampled import SampledCatalog, UniformSampler

    gen = torch.Generator().manual_seed(0)
    b, n, k, length = 2, 64, 4, 2
    user = torch.randn(b, 8, generator=gen)
    item = torch.randn(n, 8, generator=gen)
    item[:k] += 3.0 * user.mean(0)
    candidates = torch.arange(k).expand(b, k).clone()
    rewards, logged = torch.full((b, length), 10.0), torch.full((b, length), -14.0)
    u, it = user.to(dtypes[0]).requires_grad_(), item.to(dtypes[1]).requires_grad_()
    if placement == "embedding":
        catalog = EmbeddingCatalog(u, it)
    elif placement == "sampled":
        catalog = SampledCatalog(u, it, sampler=UniformSampler(32), head_items=candidates,
                                 generator=torch.Generator().manual_seed(1))
    else:
        pytest.importorskip("torchrec")
        from capg_rec.torchrec.catalog import ShardedEmbeddingCatalog

        catalog = ShardedEmbeddingCatalog(u, it, num_items=n)
    method = "with_replacement" if placement == "sampled" else "mean_field"
    OffPolicyCAPGLoss(k, method=method)(catalog, candidates, candidates[:, :length], rewards, logged).backward()
    assert torch.isfinite(u.grad).all() and torch.isfinite(it.grad).all()


def test_the_earlier_keyword_still_works_with_a_deprecation_warning():
    """Found by review: renaming forward's logged_log_propensity to logged_log_inclusion broke keyword callers."""
    logits, candidates, chosen, rewards, logged = _logged_rows(4)
    loss = OffPolicyCAPGLoss(candidates.shape[1])
    with pytest.warns(DeprecationWarning, match="logged_log_inclusion"):
        old = loss(logits, candidates, chosen, rewards, logged_log_propensity=logged)
    torch.testing.assert_close(old, loss(logits, candidates, chosen, rewards, logged_log_inclusion=logged))
    with pytest.raises(TypeError, match="only"):
        loss(logits, candidates, chosen, rewards, logged, logged_log_propensity=logged)
    with pytest.raises(TypeError, match="missing"):
        loss(logits, candidates, chosen, rewards)


def test_offpolicy_loss_is_twice_differentiable_with_constant_weights():
    """Hessian-vector product of the off-policy loss = w times that of on-policy CA-PG (B = L = 1)."""
    logits, candidates, chosen, rewards, logged = _logged_rows(1, b=1, length=1)
    k = candidates.shape[1]
    w = F.importance_weights(inclusion_log_prob(logits, chosen, k) - logged)
    v = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def hvp(loss):
        (g,) = torch.autograd.grad(loss, logits, create_graph=True)
        return torch.autograd.grad((g * v).sum(), logits)[0]

    off = hvp(OffPolicyCAPGLoss(k)(logits, candidates, chosen, rewards, logged))
    on = hvp(CAPGLoss(k)(logits, candidates, chosen, rewards))
    torch.testing.assert_close(off, w.squeeze() * on)


def test_empty_batch_and_compile_without_checks(device):
    n, k = 8, 3
    empty = torch.empty(0, n, device=device, requires_grad=True)
    ids = torch.empty(0, k, dtype=torch.long, device=device)
    for loss in (OffPolicyCAPGLoss(k)(empty, ids, ids[:, :1], torch.empty(0, 1, device=device),
                                      torch.empty(0, 1, device=device)),
                 OffPolicyVPGLoss(k)(empty, ids, ids[:, :1], torch.empty(0, 1, device=device),
                                     torch.empty(0, device=device)),
                 TopKReinforceLoss(k, self_normalize=True)(empty, ids, ids[:, :1], torch.empty(0, 1, device=device),
                                                           torch.empty(0, 1, device=device))):
        assert loss.item() == 0.0
    logits, candidates, chosen, rewards, logged = (t.to(device) for t in _logged_rows(3, dtype=torch.float32))
    capg_swr = functools.partial(F.offpolicy_capg_loss, method="with_replacement")  # the weights are what is new
    for fn, extra in ((capg_swr, logged), (F.offpolicy_vpg_loss, logged.sum(1)), (F.topk_reinforce_loss, logged)):
        compiled = torch.compile(lambda *a: fn(*a, self_normalize=True, max_weight=2.0, validate_args=False),
                                 fullgraph=True, backend="eager")(logits, candidates, chosen, rewards, extra)
        eager = fn(logits, candidates, chosen, rewards, extra, self_normalize=True, max_weight=2.0,
                   validate_args=False)
        torch.testing.assert_close(compiled, eager)


def test_input_checks_name_the_argument():
    logits, candidates, chosen, rewards, logged = _logged_rows(4)
    k = candidates.shape[1]
    loss = OffPolicyCAPGLoss(k)
    with pytest.raises(ValueError, match="logged_log_inclusion"):  # the module's argument is the functional's
        loss(logits, candidates, chosen, rewards, logged_log_inclusion=logged[:, :1])
    with pytest.raises(TypeError, match="logged_log_inclusion"):
        loss(logits, candidates, chosen, rewards, logged.tolist())
    with pytest.raises(TypeError, match="logged_log_inclusion"):
        loss(logits, candidates, chosen, rewards, logged.long())
    with pytest.raises(ValueError, match="logged_log_inclusion"):
        loss(logits, candidates, chosen, rewards, logged[:, :1])
    with pytest.raises(ValueError, match="logged_log_inclusion"):
        loss(logits, candidates, chosen, rewards, logged.clone().fill_(math.nan))
    with pytest.raises(ValueError, match="logged_log_inclusion"):
        loss(logits, candidates, chosen, rewards, logged.clone().fill_(-math.inf))
    with pytest.raises(ValueError, match="logged_log_inclusion must be <= 0"):
        loss(logits, candidates, chosen, rewards, logged + 0.01 - logged.max())
    loss(logits, candidates, chosen, rewards, logged.clamp(max=0) * 0 + 5e-5)  # rounding above 0 is accepted
    swr = OffPolicyCAPGLoss(k, method="with_replacement")
    swr(logits, candidates, chosen, rewards, torch.full_like(logged, math.log(k)))  # an expected count up to K
    with pytest.raises(ValueError, match="logged_log_inclusion must be <= 1.09861"):
        swr(logits, candidates, chosen, rewards, torch.full_like(logged, math.log(k) + 0.01))
    with pytest.raises(ValueError, match="logged_log_prob"):
        OffPolicyVPGLoss(k)(logits, candidates, chosen, rewards, logged)
    with pytest.raises(ValueError, match="logged_log_prob must be <= 0"):
        OffPolicyVPGLoss(k)(logits, candidates, chosen, rewards, torch.ones(len(logits), dtype=torch.float64))
    with pytest.raises(ValueError, match="logged_log_item_prob"):
        TopKReinforceLoss(k)(logits, candidates, chosen, rewards, logged.clone().fill_(math.inf))
    with pytest.raises(ValueError, match="max_weight"):
        OffPolicyCAPGLoss(k, max_weight=0.0)
    with pytest.raises(TypeError, match="max_weight"):
        F.offpolicy_capg_loss(logits, candidates, chosen, rewards, logged, max_weight="10")
    with pytest.raises(TypeError, match="self_normalize"):
        OffPolicyVPGLoss(k, self_normalize=1)
    OffPolicyCAPGLoss(k, validate_args=False)(logits, candidates, chosen, rewards, logged + 1.0)  # unchecked


def test_catalog_objects_give_the_dense_losses():
    """An EmbeddingCatalog (streamed in chunks) gives the same off-policy losses and gradients as its logits."""
    g = torch.Generator().manual_seed(6)
    b, n, m, d, k = 3, 40, 2, 4, 5
    user = torch.randn(b, m, d, generator=g, dtype=torch.float64, requires_grad=True)
    item = torch.randn(n, m, d, generator=g, dtype=torch.float64)
    logits = torch.einsum("bmd,nmd->bmn", user, item)
    candidates = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
    chosen, rewards = candidates[:, 1:3], torch.rand(b, 2, generator=g, dtype=torch.float64)
    logged = torch.rand(b, 2, generator=g, dtype=torch.float64).log() - 1.0
    catalog = EmbeddingCatalog(user, item, chunk_size=16)
    for loss_fn, extra in ((OffPolicyCAPGLoss(k, max_weight=5.0), logged), (OffPolicyVPGLoss(k), logged.sum(1) * 3),
                           (TopKReinforceLoss(k, self_normalize=True), logged)):
        dense, streamed = loss_fn(logits, candidates, chosen, rewards, extra), loss_fn(catalog, candidates, chosen,
                                                                                      rewards, extra)
        torch.testing.assert_close(streamed, dense)
        torch.testing.assert_close(torch.autograd.grad(streamed, user)[0],
                                   torch.autograd.grad(dense, user, retain_graph=True)[0])


@pytest.mark.parametrize("bad, error", [([0.0, 1.0], TypeError), (torch.tensor([0, 1]), TypeError)])
def test_importance_weights_name_a_wrong_type(bad, error):
    """A list or an integer tensor: a TypeError naming log_ratio (before: an AttributeError, or a TypeError
    from inside torch.finfo)."""
    with pytest.raises(error, match="log_ratio must"):
        F.importance_weights(bad)


def test_self_normalised_weights_do_not_underflow_when_every_ratio_is_tiny():
    """Regression (found by review): SNIPS weights were exp(log ratio) / mean, so a batch whose every shown item is
    e^-87 less likely under π_θ than under π₀ underflowed to zeros in float32: the loss and its gradient were 0
    (float64: 115.3 and 0.889). They are now taken relative to the largest, as normalisation allows."""
    log_ratio = torch.tensor([-110.0, -111.0, -112.0, -100.0], dtype=torch.float64)
    want = torch.softmax(log_ratio, 0) * 4
    for dtype in (torch.float64, torch.float32):
        torch.testing.assert_close(F.importance_weights(log_ratio.to(dtype), self_normalize=True), want.to(dtype))
    assert torch.equal(F.importance_weights(torch.full((3,), -math.inf), self_normalize=True), torch.zeros(3))
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 120.0, 120.0]] * 2)
    cand, rewards, logged = torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 1), torch.tensor([[0.5], [0.3]]).log()
    out = []
    for dtype in (torch.float64, torch.float32):
        x = logits.to(dtype).requires_grad_()
        loss = F.offpolicy_capg_loss(x, cand, cand[:, :1], rewards.to(dtype), logged, self_normalize=True)
        out.append((loss.detach().double(), torch.autograd.grad(loss, x)[0].double()))
    assert float(out[0][0]) > 100.0
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-5, atol=1e-7)


def test_logged_draws_may_hold_items_the_trained_esr_masks():
    """Regression (found by review): a logged draw holding an item that the trained ESR masks (a valid row: the
    logging ESR drew it) was refused by the checks ("the ESR cannot draw them"), and off-policy V-PG was NaN without
    them (weight 0 times log π = -inf). Such a row adds 0 to V-PG; CA-PG and top-K REINFORCE take its shown items'
    terms, 0 for a shown item the ESR masks; every gradient is finite."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6, dtype=torch.float64)
    logits[:, 2] = -math.inf
    logits[1, 3] = -math.inf
    cand, shown = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([[0], [3]])
    rewards = torch.ones(2, 1, dtype=torch.float64)
    per_item = -torch.ones(2, 1, dtype=torch.float64)
    for validate in (True, False):
        x = logits.clone().requires_grad_()
        losses = {"vpg": F.offpolicy_vpg_loss(x, cand, shown, rewards, torch.full((2,), -5.0, dtype=torch.float64),
                                              reduction="none", validate_args=validate),
                  "capg": F.offpolicy_capg_loss(x, cand, shown, rewards, per_item, reduction="none",
                                                validate_args=validate),
                  "topk": F.topk_reinforce_loss(x, cand, shown, rewards, per_item, reduction="none",
                                                validate_args=validate)}
        assert float(losses["vpg"].abs().sum()) == 0.0
        for name in ("capg", "topk"):
            assert float(losses[name][1]) == 0.0 and float(losses[name][0]) != 0.0, name
        for name, loss in losses.items():
            (grad,) = torch.autograd.grad(loss.sum(), x)
            assert bool(torch.isfinite(grad).all()), name
        alone = F.offpolicy_capg_loss(logits[:1], cand[:1], shown[:1], rewards[:1], per_item[:1], reduction="none")
        torch.testing.assert_close(losses["capg"][:1].detach(), alone)


def test_self_normalised_weights_are_the_same_for_half_logits():
    """Regression (found by review): the float16 overflow cap (~254) was taken before the normalisation, which
    changed the weights' ratios: a SNIPS loss 9% off float32's for float16 logits of the same values."""
    g = torch.Generator().manual_seed(4)
    batch, n, k, length = 4, 7, 3, 2
    logits = (torch.randn(batch, n, generator=g, dtype=torch.float64) * 3).half().double()  # float16 values
    candidates = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(batch)])
    shown, rewards = candidates[:, :length], torch.rand(batch, length, generator=g, dtype=torch.float64)
    logged_set = torch.full((batch,), -12.0, dtype=torch.float64)
    logged_items = torch.full((batch, length), -6.0, dtype=torch.float64)
    for loss_fn, logged in ((OffPolicyVPGLoss(k, self_normalize=True), logged_set),
                            (OffPolicyCAPGLoss(k, self_normalize=True, method="exact"), logged_items)):
        want = loss_fn(logits.float(), candidates, shown, rewards.float(), logged.float())
        got = loss_fn(logits.half(), candidates, shown, rewards.float(), logged.float())
        torch.testing.assert_close(got, want, rtol=1e-3, atol=0)  # float16 scores, float32 compute: ~eps16 apart


def test_logged_candidates_beyond_the_new_esrs_unmasked_items_are_refused():
    """Regression (found by review): with one expert, a new ESR that masks all but 2 items has no inclusion
    probability for K = 3 (inclusion_log_prob refuses it), but the off-policy CA-PG losses scored log 1 = 0 and
    weighed it 1/π₀ silently: the logged candidates were drawn by another ESR. CA-PG-SwR's expected count stays
    defined."""
    logits = torch.tensor([[0.5, -math.inf, 0.2, -math.inf, -math.inf]], dtype=torch.float64, requires_grad=True)
    candidates, shown = torch.tensor([[0, 1, 2]]), torch.tensor([[0, 2]])
    rewards, logged = torch.ones(1, 2, dtype=torch.float64), torch.full((1, 2), math.log(0.5), dtype=torch.float64)
    for method in ("mean_field", "exact", "plugin", "enumerate"):
        with pytest.raises(ValueError, match="num_candidates=3 needs, under the experts .0. of its blocks, .3."):
            F.offpolicy_capg_loss(logits, candidates, shown, rewards, logged, method=method)
    count = torch.log(torch.full((1, 2), 0.9, dtype=torch.float64))
    assert torch.isfinite(F.offpolicy_capg_loss(logits, candidates, shown, rewards, count, method="with_replacement"))


def test_self_normalised_weights_at_extreme_ratios_in_every_dtype():
    """A later review of the fix above: the log-ratio's own dtype cap (about 44 for float32) still clipped before
    normalising (float32 weights unlike float64 ones), and without any cap after it the normalised weights, which
    reach the batch's size, overflowed float16 gradients."""
    log_ratio = torch.tensor([0.0, 40.0, 60.0], dtype=torch.float64)
    want = F.importance_weights(log_ratio, self_normalize=True)
    torch.testing.assert_close(F.importance_weights(log_ratio.float(), self_normalize=True), want.float())
    g = torch.Generator().manual_seed(0)
    batch, n, k, length = 50_000, 12, 3, 2
    logits = torch.randn(batch, n, generator=g)
    candidates = torch.rand(batch, n, generator=g).argsort(1)[:, :k]
    logged = torch.full((batch, length), math.log(0.5), dtype=torch.float64)
    logged[0, 0] = -30.0  # one row the logging policy almost never showed: its weight dominates the batch
    for dtype in (torch.float16, torch.bfloat16):
        half = logits.to(dtype).requires_grad_()
        F.offpolicy_capg_loss(half, candidates, candidates[:, :length], torch.ones(batch, length), logged,
                              self_normalize=True, reduction="sum", validate_args=False).backward()
        assert torch.isfinite(half.grad).all(), dtype


def test_logged_propensities_beyond_the_scores_dtype_are_refused_and_infinite_ratios_normalise():
    """Found by review: a float64 logged log-propensity of -1e300 is finite, but -inf once cast to float32 logits'
    dtype (a zero propensity): its weight was +inf, and the self-normalised loss NaN. It is now refused, naming the
    argument, by every off-policy loss; importance_weights normalises +inf log-ratios to their limit (1 each before
    the mean, the finite ones 0) instead of NaN."""
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    candidates = torch.tensor([[0, 1, 2], [3, 4, 5]])
    rewards = torch.ones(2, 1)
    logged = torch.tensor([[-1e300], [-1.0]], dtype=torch.float64)
    for normalise in (False, True):
        with pytest.raises(ValueError, match=r"logged_log_inclusion must be finite in the scores' dtype torch.float32"):
            F.offpolicy_capg_loss(logits, candidates, candidates[:, :1], rewards, logged, self_normalize=normalise)
    with pytest.raises(ValueError, match=r"logged_log_prob must be finite in the scores. dtype"):
        F.offpolicy_vpg_loss(logits, candidates, candidates[:, :1], rewards, logged[:, 0])
    with pytest.raises(ValueError, match=r"logged_log_item_prob must be finite in the scores' dtype"):
        F.topk_reinforce_loss(logits, candidates, candidates[:, :1], rewards, logged)
    fine = F.offpolicy_capg_loss(logits.double(), candidates, candidates[:, :1], rewards, logged, self_normalize=True)
    assert torch.isfinite(fine)  # float64 scores: the weight is capped, then normalised
    weights = F.importance_weights(torch.tensor([math.inf, 0.0, -math.inf, math.inf]), self_normalize=True)
    torch.testing.assert_close(weights, torch.tensor([2.0, 0.0, 0.0, 2.0]))


def test_self_normalised_weights_of_a_large_batch_are_not_capped_for_half_logits():
    """Found by review: after the normalisation, SNIPS weights were capped at float16's overflow cap (256) for float16
    logits, while one weight of a batch of B·L = 2560 reaches ~2560 (their mean is 1): the loss came out 10x smaller
    than float32's. Under the "mean" reduction they are at most the number of weights and their gradients at most that
    over the rows, which float16 holds: the losses now agree ("sum" keeps the cap, test above)."""
    g = torch.Generator().manual_seed(0)
    batch, n, k, length = 512, 50, 10, 5
    logits = torch.randn(batch, n, generator=g).half().float()  # float16 values
    candidates = sample_candidates(logits, k, generator=g)
    shown, rewards = candidates[:, :length], torch.ones(batch, length)
    logged = inclusion_log_prob(logits, shown, k)
    logged[0, 0] = -30.0  # one shown item that the logging ESR almost never proposed
    losses, grads = {}, {}
    for dtype in (torch.float16, torch.float32):
        leaf = logits.to(dtype).requires_grad_()
        losses[dtype] = F.offpolicy_capg_loss(leaf, candidates, shown, rewards, logged, self_normalize=True)
        (grads[dtype],) = torch.autograd.grad(losses[dtype], leaf)
    torch.testing.assert_close(losses[torch.float16], losses[torch.float32], rtol=1e-3, atol=0)
    assert torch.isfinite(grads[torch.float16]).all()


@pytest.mark.parametrize("other", [[], [-800.0, -801.0], [math.inf, 0.0], [-math.inf], [3.0, -2.0]])
def test_self_normalised_weights_over_ranks_equal_one_process_over_their_rows(other):
    """What a sharded catalog's rank computes of its SNIPS weights (from every rank's statistics, stacked by
    ``_stack_batches``) equals one process's weights over the global batch, where another rank holds no rows, only
    weights ~800 nats below (exp would overflow relative to the wrong top), an infinite weight (which takes the
    whole mass), or none but zeros."""
    from capg_rec.catalog import DenseCatalog

    mine = torch.tensor([0.0, 1.0, -math.inf], dtype=torch.float64)
    theirs = torch.tensor(other, dtype=torch.float64)

    class Sharded(DenseCatalog):  # a rank whose batch shares the global batch with another rank's `theirs`
        def _stack_batches(self, x):
            top = theirs.amax() if theirs.numel() else torch.tensor(-math.inf, dtype=torch.float64)
            relative = F._relative_weights(theirs).sum()
            return torch.stack([torch.stack([top, relative, torch.tensor(float(theirs.numel()),
                                                                           dtype=torch.float64)]), x])

    catalog = Sharded(torch.zeros(1, 2, dtype=torch.float64))
    got = F._weights(catalog, mine, None, True)
    want = F.importance_weights(torch.cat([theirs, mine]), self_normalize=True)[theirs.numel():]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("num_candidates", [2, 3])
def test_top_k_reinforce_at_small_k_follows_chen_et_al(num_candidates):
    """Found by mutation testing: skipping the multiplier at K = 2 left every test passing. The loss per row is
    -(π/β) λ_K r log π with λ_K = K (1 - π)^(K-1) and π the single-draw softmax probability (value and gradient)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    cand = torch.tensor([[0, 1, 2], [2, 3, 4], [4, 5, 0]])[:, :num_candidates]
    chosen, rewards = cand[:, :1], torch.rand(3, 1, generator=g, dtype=torch.float64)
    logged = torch.full((3, 1), -2.0, dtype=torch.float64)
    got = F.topk_reinforce_loss(logits, cand, chosen, rewards, logged, reduction="none")
    p = logits.softmax(-1).gather(1, chosen)
    weight = (p / logged.exp() * num_candidates * (1 - p) ** (num_candidates - 1)).detach()
    want = -(weight * rewards * p.log()).sum(1)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), logits)[0], torch.autograd.grad(want.sum(), logits)[0])


def test_default_weight_cap_keeps_a_rounding_step_of_margin():
    """The default cap of the log-weights is one rounding step below the largest log-weight whose weight has a
    finite square, in every dtype: the next value up (another device's exp may round it up) still squares finite
    (found by mutation testing: dropping the margin left every test passing; float16 then lost it)."""
    for dtype, cap in F._LARGEST_LOG_WEIGHT.items():
        up = torch.nextafter(torch.tensor(cap, dtype=dtype), torch.tensor(math.inf, dtype=dtype))
        assert bool(torch.isfinite(torch.exp(up) * torch.exp(up))), dtype
        up = torch.nextafter(up, torch.tensor(math.inf, dtype=dtype))  # and no more than that step: the next one over
        assert not bool(torch.isfinite(torch.exp(up) * torch.exp(up))), dtype


def _beside(rows: int, theirs: torch.Tensor) -> DenseCatalog:
    """A dense catalog of ``rows`` rows whose global batch also holds another process's log-weights ``theirs``: its
    ``_stack_batches`` adds that process's statistics, as a sharded catalog's all-gather would."""
    class Beside(DenseCatalog):
        def _stack_batches(self, x: torch.Tensor) -> torch.Tensor:
            top = theirs.amax().double() if theirs.numel() else torch.tensor(-math.inf, dtype=torch.float64)
            stats = torch.stack([top, F._relative_weights(theirs).sum(dtype=torch.float64),
                                 torch.tensor(float(theirs.numel()), dtype=torch.float64)])
            return torch.stack([x, stats])
    return Beside(torch.zeros(rows, 5, dtype=torch.float64), validate_args=False)


@pytest.mark.parametrize("case", ["empty", "zero weights", "far below", "far above", "alike"])
def test_self_normalised_weights_beside_another_process_equal_one_process_over_both(case):
    """SNIPS weights over a global batch of two processes equal one process's over the concatenated batch, where the
    other process holds no rows, only zero weights, or weights 750 nats away (beyond float64's exp; found by mutation
    testing: the global reference taken at the lowest top rather than the highest left the 2-rank parity test
    passing, and gave all zeros beside an empty process, NaN beside a far one)."""
    mine = torch.tensor([[0.0, -1.0], [0.5, -2.0], [-0.3, 0.2]], dtype=torch.float64)
    theirs = {"empty": mine[:0], "zero weights": torch.full((2, 2), -math.inf, dtype=torch.float64),
              "far below": mine - 750.0, "far above": mine[:2] + 750.0, "alike": mine[:2] * 2}[case]
    got = F._weights(_beside(3, theirs), mine, None, True)
    want = F.importance_weights(torch.cat([mine, theirs]), self_normalize=True)[:3]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0.0)
