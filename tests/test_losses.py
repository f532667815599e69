"""The losses: expected-gradient identities by enumeration, semantics, numerics, input checks."""

import math

import pytest
import torch

import capg_rec
import capg_rec.functional
from capg_rec import (CAPGLoss, DenseCatalog, EmbeddingCatalog, VPGLoss, candidate_log_prob, dcg_weights,
                      expert_of_position, inclusion_log_prob, sample_candidates)
from capg_rec._enumerate import all_draws, draw_log_probs, inclusion_probs

ESTIMATORS = {
    "vpg": lambda k, **kw: VPGLoss(k, **kw),
    "vpg_swr": lambda k, **kw: VPGLoss(k, with_replacement=True, **kw),
    "capg_exact": lambda k, **kw: CAPGLoss(k, method="exact", **kw),
    "capg_mean_field": lambda k, **kw: CAPGLoss(k, method="mean_field", **kw),
    "capg_plugin": lambda k, **kw: CAPGLoss(k, method="plugin", **kw),
    "top1": lambda k, **kw: CAPGLoss(k, **kw, method="with_replacement"),
}


def _enumerated_rollouts(n, k, m, seed, lsr_temperature=0.5):
    """Every (ordered draw A, LSR pick a) with its weight π(A)·π_LSR(a|A) (LSR: softmax of q/τ
    over A, one output), plus the logits and the expected rewards q."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, m, n, generator=g, dtype=torch.float64).requires_grad_()
    q = 1.0 + torch.rand(n, generator=g, dtype=torch.float64)
    draws = all_draws(n, k)
    log_pi = draw_log_probs(logits, draws, expert_of_position(k, m))[0]  # [S]
    lsr = torch.softmax(q[draws] / lsr_temperature, dim=1)  # [S, K]: π_LSR(a_j | A)
    rows_draw = torch.arange(len(draws)).repeat_interleave(k)
    chosen = draws.reshape(-1, 1)
    weight = (log_pi.exp()[rows_draw] * lsr.reshape(-1)).detach()
    return logits, q, draws, log_pi, lsr, rows_draw, chosen, weight


@pytest.mark.parametrize(("n", "k", "m"), [(5, 2, 1), (5, 3, 1), (6, 3, 2), (5, 3, 3)])
def test_vpg_expected_gradient_is_policy_gradient(n, k, m):
    """E[∇ V-PG loss] = -∇V exactly, V = Σ_A π(A) Σ_a π_LSR(a|A) q(a)."""
    logits, q, draws, log_pi, lsr, rows_draw, chosen, weight = _enumerated_rollouts(n, k, m, seed=n + k + m)
    value = (log_pi.exp() * (lsr * q[draws]).sum(1)).sum()
    (grad_value,) = torch.autograd.grad(value, logits, retain_graph=True)
    loss = VPGLoss(k, reduction="none")(logits.expand(len(chosen), -1, -1), draws[rows_draw], chosen,
                                        q[chosen])
    (grad_loss,) = torch.autograd.grad((weight * loss).sum(), logits)
    torch.testing.assert_close(grad_loss, -grad_value)


@pytest.mark.parametrize(("n", "k"), [(5, 2), (6, 3), (4, 3)])
def test_capg_expected_gradient_is_the_papers_lemma(n, k):
    """E[∇ CA-PG loss] = -Σ_a ∇π(S^K(a)) · E[π_LSR(a|A) | a ∈ A] · q(a) (the paper's Lemma:
    an LSR-propensity-discounted reward), with the exact inclusion probability."""
    logits, q, draws, log_pi, lsr, rows_draw, chosen, weight = _enumerated_rollouts(n, k, 1, seed=n * k)
    incl = inclusion_probs(logits, expert_of_position(k, 1))[0]  # [N], differentiable
    shown = torch.zeros(n, dtype=torch.float64).index_add_(0, chosen[:, 0], weight)  # P(a shown)
    discount = (shown / incl).detach()  # E[π_LSR(a|A) | a ∈ A]
    (grad_lemma,) = torch.autograd.grad((incl * discount * q).sum(), logits, retain_graph=True)
    loss = CAPGLoss(k, method="exact", reduction="none")(logits.expand(len(chosen), -1, -1), draws[rows_draw],
                                                         chosen, q[chosen])
    (grad_loss,) = torch.autograd.grad((weight * loss).sum(), logits)
    torch.testing.assert_close(grad_loss, -grad_lemma, rtol=1e-4, atol=1e-7)


def _batch(seed=0, b=6, m=2, n=40, k=6, l=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, m, n, generator=g, dtype=dtype)
    cand = sample_candidates(logits, k, generator=g)
    chosen = cand[:, torch.tensor([4, 0, 2])[:l]]
    rewards = torch.rand(b, l, generator=g, dtype=dtype) + 0.5
    return logits, cand, chosen, rewards


def test_loss_values_are_the_documented_formulas():
    logits, cand, chosen, rewards = _batch()
    alpha = dcg_weights(3, dtype=torch.float64)
    adv = rewards * alpha
    vpg = VPGLoss(6, temperature=0.5)(logits, cand, chosen, rewards, position_weights=alpha)
    torch.testing.assert_close(vpg, -(adv.sum(1) * candidate_log_prob(logits, cand, temperature=0.5)).mean())
    for method in ("mean_field", "plugin", "with_replacement"):
        capg = CAPGLoss(6, method=method)(logits, cand, chosen, rewards, position_weights=alpha)
        score = inclusion_log_prob(logits, chosen, 6, method=method)
        torch.testing.assert_close(capg, -(adv * score).sum(1).mean())


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_baseline_weights_and_reduction(name):
    logits, cand, chosen, rewards = _batch(seed=1)
    loss_fn = ESTIMATORS[name](6, reduction="none")
    per_row = loss_fn(logits, cand, chosen, rewards)
    assert per_row.shape == (6,)
    torch.testing.assert_close(ESTIMATORS[name](6)(logits, cand, chosen, rewards), per_row.mean())
    torch.testing.assert_close(ESTIMATORS[name](6, reduction="sum")(logits, cand, chosen, rewards), per_row.sum())
    b = torch.rand(6, dtype=torch.float64)
    torch.testing.assert_close(loss_fn(logits, cand, chosen, rewards, baseline=b),
                               loss_fn(logits, cand, chosen, rewards - b[:, None]))
    # [B, 1] broadcasts as [B] (it was refused: rewards.mean(1, keepdim=True) is the idiom)
    torch.testing.assert_close(loss_fn(logits, cand, chosen, rewards, baseline=b[:, None]),
                               loss_fn(logits, cand, chosen, rewards, baseline=b))
    # one baseline for every row: a 0-dim tensor (rewards.mean()) or a number (both were refused, found by review)
    mean = rewards.mean()
    for scalar in (mean, float(mean)):
        torch.testing.assert_close(loss_fn(logits, cand, chosen, rewards, baseline=scalar),
                                   loss_fn(logits, cand, chosen, rewards, baseline=mean.expand(6)))
    single, checked = (logits.float(), cand, chosen, rewards.float()), ESTIMATORS[name](6, validate_args=True)
    torch.testing.assert_close(checked(*single, baseline=mean),  # a float64 scalar beside float32 rewards
                               checked(*single, baseline=mean.float().expand(6)))
    with pytest.raises(TypeError, match="baseline"):
        loss_fn(logits, cand, chosen, rewards, baseline=True)
    with pytest.raises(ValueError, match="baseline"):
        loss_fn(logits, cand, chosen, rewards, baseline=float("nan"))
    with pytest.raises(TypeError, match="baseline must have a floating dtype"):
        loss_fn(logits, cand, chosen, rewards, baseline=torch.tensor(1))
    b2 = torch.rand(6, 3, dtype=torch.float64)
    alpha = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    torch.testing.assert_close(loss_fn(logits, cand, chosen, rewards, baseline=b2, position_weights=alpha),
                               loss_fn(logits, cand, chosen, (rewards - b2) * alpha))


@pytest.mark.parametrize("name", [*sorted(ESTIMATORS), "offpolicy_capg", "offpolicy_vpg", "topk_reinforce"])
def test_rewards_baselines_and_position_weights_are_constants(name):
    """A learned baseline (a value head's output), rewards or position weights that carry a graph get no gradient
    from a policy loss: they are constants of the estimator. Dropping the baseline's detach went unnoticed by every
    test (a review's mutation); its value head then learnt from the policy gradient."""
    logits, cand, chosen, rewards = _batch(seed=2)
    logits.requires_grad_()
    head = torch.rand(6, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64, requires_grad=True)
    graph_rewards = rewards * (1.0 + 0.0 * head[:, None])
    if name in ESTIMATORS:
        loss = ESTIMATORS[name](6)(logits, cand, chosen, graph_rewards, baseline=head * 1.0 + 0.3,
                                   position_weights=weights)
    else:
        cls = {"offpolicy_capg": capg_rec.OffPolicyCAPGLoss, "offpolicy_vpg": capg_rec.OffPolicyVPGLoss,
               "topk_reinforce": capg_rec.TopKReinforceLoss}[name]
        logged = torch.full((6,) if name == "offpolicy_vpg" else (6, 3), -1.0, dtype=torch.float64)
        loss = cls(6)(logits, cand, chosen, graph_rewards, logged, baseline=head * 1.0 + 0.3,
                      position_weights=weights)
    grads = torch.autograd.grad(loss, (logits, head, weights), allow_unused=True)
    assert grads[0] is not None and grads[1] is None and grads[2] is None, name


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("logits_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_loss_is_float32_whatever_the_rewards_dtype(name, logits_dtype):
    """Half-precision logits give a float32 loss (as autocast does for softmax losses), and so do float32 ones,
    whatever the rewards' dtype: float64 rewards gave a float64 loss, and float16 rewards of up to 1e3 summed
    their advantages in float16 (off by 0.5 in 4515) when the advantage was not cast (a review's mutation)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 30, generator=gen).to(logits_dtype).float()  # values of the logits' dtype
    cand = sample_candidates(logits, 6, generator=gen)
    chosen = cand[:, :3]
    rewards = torch.rand(8, 3, generator=gen, dtype=torch.float64) * 1e3
    want = ESTIMATORS[name](6)(logits.double(), cand, chosen, rewards.half().double())
    for rewards_dtype in (torch.float16, torch.float32, torch.float64):
        got = ESTIMATORS[name](6)(logits.to(logits_dtype), cand, chosen, rewards.half().to(rewards_dtype))
        assert got.dtype == torch.float32, (rewards_dtype, got.dtype)
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=0.0)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_embedding_catalog_is_a_drop_in(name):
    g = torch.Generator().manual_seed(3)
    user = torch.randn(5, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    item = torch.randn(60, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    catalog = EmbeddingCatalog(user, item, temperature=0.7, chunk_size=16)
    cand = sample_candidates(catalog, 5, generator=g)
    chosen, rewards = cand[:, :2], torch.rand(5, 2, generator=g, dtype=torch.float64)
    loss_e = ESTIMATORS[name](5)(catalog, cand, chosen, rewards)
    loss_d = ESTIMATORS[name](5, temperature=0.7)(torch.einsum("bmd,nmd->bmn", user, item), cand, chosen, rewards)
    torch.testing.assert_close(loss_e, loss_d)
    grads_e = torch.autograd.grad(loss_e, (user, item))
    grads_d = torch.autograd.grad(loss_d, (user, item))
    for a, b in zip(grads_e, grads_d):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("gap", [30.0, 1e4])
def test_float32_extreme_logits_give_finite_loss_and_grad(name, gap):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=g)
    logits[:, :20] += gap  # a confident policy: the top-20 hold all the mass
    logits.requires_grad_()
    cand = sample_candidates(logits, 20, generator=g)
    chosen = torch.cat([cand[:, :2], cand[:, -1:]], 1)
    loss = ESTIMATORS[name](20)(logits, cand, chosen, torch.rand(8, 3, generator=g))
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_bad_inputs_raise():
    logits, cand, chosen, rewards = _batch()
    loss = CAPGLoss(6)
    with pytest.raises(ValueError, match="subset"):
        loss(logits, cand, (cand[:, :3] + 1) % 40, rewards)
    with pytest.raises(ValueError, match="rewards"):
        loss(logits, cand, chosen, rewards[:, :2])
    with pytest.raises(ValueError, match="rewards"):
        loss(logits, cand, chosen, torch.full_like(rewards, float("nan")))
    with pytest.raises(TypeError, match="rewards"):
        loss(logits, cand, chosen, rewards.long())
    with pytest.raises(ValueError, match="baseline"):
        loss(logits, cand, chosen, rewards, baseline=torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="position_weights"):
        loss(logits, cand, chosen, rewards, position_weights=torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="candidates"):
        loss(logits, cand[:, :5], chosen, rewards)
    dup = cand.clone()
    dup[:, 1] = dup[:, 0]
    with pytest.raises(ValueError, match="candidates"):
        loss(logits, dup, chosen[:, :1], rewards[:, :1])
    with pytest.raises(ValueError, match="chosen"):
        loss(logits, cand, cand[:, [0, 0, 1]], rewards)
    with pytest.raises(ValueError, match="logits"):
        loss(logits.masked_fill(logits > 2, float("inf")), cand, chosen, rewards)
    with pytest.raises(ValueError, match="masked"):
        loss(logits.scatter(2, cand[:, None, 4:5].expand(-1, 2, -1), float("-inf")), cand, chosen, rewards)
    with pytest.raises(ValueError, match="reduction"):
        VPGLoss(6, reduction="avg")
    with pytest.raises(ValueError, match="method"):
        CAPGLoss(6, method="approx")
    with pytest.raises(ValueError, match="temperature"):
        CAPGLoss(6, temperature=0.0, method="with_replacement")
    with pytest.raises(ValueError, match="num_candidates"):
        VPGLoss(0)
    with pytest.raises(ValueError, match="num_candidates"):
        VPGLoss(50)(logits, torch.arange(50).expand(6, 50) % 40, chosen, rewards)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_validate_args_false_gives_the_same_loss_and_skips_the_checks(name):
    logits, cand, chosen, rewards = _batch()
    logits = logits.requires_grad_()
    b, alpha = torch.rand(6, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    checked = ESTIMATORS[name](6, temperature=0.7)(logits, cand, chosen, rewards, baseline=b, position_weights=alpha)
    unchecked_fn = ESTIMATORS[name](6, temperature=0.7, validate_args=False)
    unchecked = unchecked_fn(logits, cand, chosen, rewards, baseline=b, position_weights=alpha)
    assert torch.equal(checked, unchecked)
    assert torch.equal(*(torch.autograd.grad(x, logits)[0] for x in (checked, unchecked)))
    assert "validate_args=False" in repr(unchecked_fn)
    # What the checks would reject now passes through: here, NaN rewards give a NaN loss.
    assert torch.isnan(unchecked_fn(logits, cand, chosen, torch.full_like(rewards, float("nan"))))
    with pytest.raises(ValueError, match="rewards"):
        ESTIMATORS[name](6)(logits, cand, chosen, torch.full_like(rewards, float("nan")))
    infinite = logits.detach().masked_fill(logits.detach() > 2, float("inf"))
    with pytest.raises(ValueError, match="logits must be finite or -inf"):
        DenseCatalog(infinite)
    assert DenseCatalog(infinite, validate_args=False).num_items == 40
    with pytest.raises(TypeError, match="validate_args must be True or False"):
        ESTIMATORS[name](6, validate_args="no")
    with pytest.raises(TypeError, match="validate_args must be True or False"):
        DenseCatalog(logits.detach(), validate_args=0)


def test_dcg_weights(device):
    torch.testing.assert_close(dcg_weights(3), torch.tensor([1.0, 1 / 1.5849625, 0.5]))
    with pytest.raises(ValueError, match="length"):
        dcg_weights(0)
    weights = dcg_weights(3, dtype=torch.float64, device=device)  # the rewards' device, for position_weights
    assert weights.device.type == torch.device(device).type and weights.dtype == torch.float64
    with pytest.raises(ValueError, match="device must name a torch device, got 'nonsense'"):
        dcg_weights(3, device="nonsense")
    with pytest.raises(TypeError, match="device must be a torch.device, a str or None, got int"):
        dcg_weights(3, device=3)


@pytest.mark.parametrize("method", ["mean_field", "exact", "plugin"])
def test_capg_losses_refuse_an_expert_with_too_few_items_for_its_block(method):
    """Regression (found by review): with a mask per expert, the CA-PG losses took a row whose second expert has
    3 unmasked items, fewer than the 6 positions up to the end of its block, and returned a finite loss (mean-field,
    exact and plug-in gave that expert's items probability 1), where inclusion_log_prob and sample_candidates raise.
    The off-policy loss too; V-PG and CA-PG-SwR, whose log π(A) and expected count need no such assumption, still
    score the draw."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8)
    x[0, 1, 3:] = -math.inf  # expert 1 may draw only items 0, 1, 2
    cand, chosen, rewards = torch.tensor([[5, 6, 7, 0, 1, 2]]), torch.tensor([[5, 0]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"needs, under the experts \[0, 1\] of its blocks, \[3, 6\] unmasked items"):
        CAPGLoss(6, method=method)(x, cand, chosen, rewards)
    with pytest.raises(ValueError, match="unmasked items"):
        capg_rec.functional.offpolicy_capg_loss(x, cand, chosen, rewards, torch.full((1, 2), -1.0), method=method)
    assert torch.isfinite(VPGLoss(6)(x, cand, chosen, rewards))
    assert torch.isfinite(CAPGLoss(6, method="with_replacement")(x, cand, chosen, rewards))
    x[0, 1, 3:6] = 0.0  # 6 items now: passes
    assert torch.isfinite(CAPGLoss(6, method=method)(x, cand, chosen, rewards))


def test_a_loss_module_checks_the_width_of_candidates_among_its_input_checks():
    """The modules' K is checked with the other structure checks (collective on a shared catalog: it was a check of
    the module's own, raised on one rank alone); the functional losses take it as ``num_candidates``."""
    logits = torch.randn(3, 8)
    candidates = torch.stack([torch.randperm(8)[:2] for _ in range(3)])
    chosen, rewards = candidates[:, :1], torch.ones(3, 1)
    for loss in (CAPGLoss(3), VPGLoss(3)):
        with pytest.raises(ValueError, match="candidates must have num_candidates=3 columns, got 2"):
            loss(logits, candidates, chosen, rewards)
    with pytest.raises(ValueError, match="num_candidates=3 columns"):
        capg_rec.functional.capg_loss(logits, candidates, chosen, rewards, num_candidates=3)
    assert torch.isfinite(capg_rec.functional.capg_loss(logits, candidates, chosen, rewards, num_candidates=2))


@pytest.mark.parametrize("loss_fn", [capg_rec.functional.capg_loss, capg_rec.functional.vpg_loss])
def test_the_advantage_is_computed_as_wide_as_the_scores(loss_fn):
    """Rewards of a narrower dtype than the scores: the advantage (rewards less the baseline, times the position
    weights) was computed in the rewards' dtype, so float16 rewards of 40,000 times a weight of 2 gave a loss of inf
    and non-finite gradients with the checks on, a Python baseline was rounded to the rewards' dtype (a float64 loss
    off by 0.4% for bfloat16 rewards and baseline=0.3) or refused as non-finite (70,000 for float16 rewards) (found by
    review). It is computed in the wider of the two dtypes."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        logits = torch.randn(2, 10, generator=gen, dtype=dtype, requires_grad=True)
        candidates = capg_rec.sample_candidates(logits, 3, generator=gen)
        chosen = candidates[:, :2]
        for rewards, weights, baseline in ((torch.tensor([[40960.0, 1.0], [2.0, 3.0]]), torch.tensor([2.0, 1.0]), None),
                                           (torch.tensor([[1.0, 0.0], [0.0, 1.0]]), None, 0.3),
                                           (torch.tensor([[1.0, 0.0], [0.0, 1.0]]), None, 70000.0)):
            want = loss_fn(logits, candidates, chosen, rewards.to(dtype), baseline=baseline,
                           position_weights=None if weights is None else weights.to(dtype))
            (want_grad,) = torch.autograd.grad(want, logits)
            for narrow in (torch.float16, torch.bfloat16):  # the rewards and weights are exact in both
                got = loss_fn(logits, candidates, chosen, rewards.to(narrow), baseline=baseline,
                              position_weights=None if weights is None else weights.to(narrow))
                (grad,) = torch.autograd.grad(got, logits)
                assert got.dtype == dtype
                torch.testing.assert_close(got, want, rtol=0, atol=0)
                torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
