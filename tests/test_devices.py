"""Each device against the CPU: the losses, inclusion methods, catalogs, samplers, logging and off-policy
evaluation computed on a device agree with the same computation on the CPU (CUDA's scans, sorts, scatters and
reductions are other kernels than the CPU's), and the device's own random draws follow the exact inclusion
probabilities. On a machine without CUDA the comparisons run CPU against CPU and the draws on the CPU."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from capg_rec import (CAPGLoss, DrawnSample, EmbeddingCatalog, InBatchSampler, MixedSampler, OffPolicyCAPGLoss,
                      OffPolicyVPGLoss, SampledCatalog, TopKReinforceLoss, UniformSampler, VPGLoss, candidate_log_prob,
                      greedy_candidates, sample_candidates)
from capg_rec._enumerate import inclusion_probs
from capg_rec.ann import ExactIndex
from capg_rec.logs import explore_candidates, log_propensities
from capg_rec.offpolicy_evaluation import off_policy_value
from capg_rec.plackett_luce import expert_of_position
from tests.stats import assert_counts_match

CPU = torch.device("cpu")
ESTIMATORS = ["vpg", "vpg_swr", "with_replacement", "mean_field", "plugin", "exact"]


def _loss(name: str, k: int) -> torch.nn.Module:
    if name in ("vpg", "vpg_swr"):
        return VPGLoss(k, with_replacement=name == "vpg_swr")
    return CAPGLoss(k, method=name)


def _tolerance(dtype: torch.dtype, scale: float) -> dict[str, float]:
    """Two devices' results in one dtype differ by their summation orders: a few dozen roundings of numbers
    of size ``scale``."""
    eps = torch.finfo(dtype).eps
    return {"rtol": 64 * eps, "atol": 64 * eps * scale}


def _assert_same(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> None:
    torch.testing.assert_close(got.cpu(), want.cpu(), **_tolerance(want.dtype, scale))


def _inputs(num_experts: int, dtype: torch.dtype, seed: int = 0):
    """A batch whose rows have masked items, spread scores and a repeated expert map."""
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(5, num_experts, 40, generator=g, dtype=torch.float64)).to(dtype)
    logits[1, :, :7] = float("-inf")
    logits[3, :, 30:] = float("-inf")
    cand = sample_candidates(logits.double(), 6, generator=g)
    rewards = torch.rand(5, 3, generator=g, dtype=torch.float64).to(dtype)
    return logits.squeeze(1), cand, cand[:, [4, 0, 2]], rewards


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("num_experts", [1, 2])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_losses_and_gradients_agree_with_the_cpu(device, name, num_experts, dtype):
    logits, cand, chosen, rewards = _inputs(num_experts, dtype)
    loss_fn = _loss(name, 6)
    results = []
    for where in (CPU, device):
        x = logits.to(where).requires_grad_()
        loss = loss_fn(x, cand.to(where), chosen.to(where), rewards.to(where))
        (grad,) = torch.autograd.grad(loss, x)
        assert loss.device.type == where.type
        results.append((loss, grad))
    (want, want_grad), (got, got_grad) = results
    _assert_same(got, want, scale=20.0)
    _assert_same(got_grad, want_grad)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_chunked_embedding_catalog_agrees_with_the_cpu(device, name):
    """Scores streamed in chunks (the path of 10^5–10^6 items), and their second derivatives."""
    g = torch.Generator().manual_seed(1)
    user = torch.randn(4, 2, 8, generator=g, dtype=torch.float64)
    item = torch.randn(70, 2, 8, generator=g, dtype=torch.float64)
    cand = sample_candidates(EmbeddingCatalog(user, item), 5, generator=g)
    chosen, rewards = cand[:, :2], torch.rand(4, 2, generator=g, dtype=torch.float64)
    results = []
    for where in (CPU, device):
        u, v = user.to(where).requires_grad_(), item.to(where).requires_grad_()
        loss = _loss(name, 5)(EmbeddingCatalog(u, v, chunk_size=16), cand.to(where), chosen.to(where),
                              rewards.to(where))
        grads = torch.autograd.grad(loss, (u, v), create_graph=True)
        (hvp,) = torch.autograd.grad(grads[0].square().sum(), u)
        results.append((loss, *grads, hvp))
    for got, want in zip(results[1], results[0]):
        _assert_same(got, want, scale=10.0)


@pytest.mark.parametrize("sampler", ["uniform", "in_batch", "mixed"])
@pytest.mark.parametrize("name", ESTIMATORS)  # 500 items: read whole by the exact method, mean-field and plug-in
def test_sampled_catalog_agrees_with_the_cpu_on_the_same_draw(device, name, sampler):
    """A sample drawn on the device, with its sampler's streaming state there, gives the CPU's estimates when
    the same ids are scored on the CPU (an index head from an exact index on each side)."""
    g = torch.Generator().manual_seed(2)
    user = torch.randn(6, 8, generator=g, dtype=torch.float64)
    item = torch.randn(500, 8, generator=g, dtype=torch.float64)
    cand = sample_candidates(EmbeddingCatalog(user, item), 5, generator=g)
    chosen, rewards = cand[:, :2], torch.rand(6, 2, generator=g, dtype=torch.float64)
    make = {"uniform": lambda: UniformSampler(64), "in_batch": lambda: InBatchSampler(num_buckets=256),
            "mixed": lambda: MixedSampler(UniformSampler(32), InBatchSampler(num_buckets=256))}[sampler]
    negatives, gen = make(), torch.Generator(device).manual_seed(3)
    for _ in range(3):  # a few steps of streaming frequency estimates, on the device
        ids = negatives.draw(500, cand.to(device), generator=gen, device=device)
    assert ids.device.type == device.type
    results = []
    for where in (CPU, device):
        u, v = user.to(where).requires_grad_(), item.to(where).requires_grad_()
        catalog = SampledCatalog(u, v, sampler=DrawnSample(ids.to(where), negatives), head_items=cand.to(where),
                                 index=ExactIndex(v.detach()), head_size=10)
        loss = _loss(name, 5)(catalog, cand.to(where), chosen.to(where), rewards.to(where))
        results.append((loss, *torch.autograd.grad(loss, (u, v))))
    for got, want in zip(results[1], results[0]):
        _assert_same(got, want, scale=10.0)


@pytest.mark.parametrize("self_normalize", [False, True])
@pytest.mark.parametrize("loss_cls", [OffPolicyCAPGLoss, OffPolicyVPGLoss, TopKReinforceLoss])
@pytest.mark.parametrize("num_experts", [1, 2])
def test_off_policy_losses_agree_with_the_cpu(device, loss_cls, num_experts, self_normalize):
    logits, cand, chosen, rewards = _inputs(num_experts, torch.float64, seed=4)
    logged_logits = logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(5),
                                         dtype=torch.float64)
    if loss_cls is OffPolicyCAPGLoss:
        logged = log_propensities(logged_logits, cand, chosen).log_inclusion
    elif loss_cls is OffPolicyVPGLoss:
        logged = candidate_log_prob(logged_logits, cand)
    else:
        first = logged_logits if num_experts == 1 else logged_logits[:, 0]
        logged = first.log_softmax(-1).gather(-1, chosen)
    results = []
    for where in (CPU, device):
        x = logits.to(where).requires_grad_()
        loss = loss_cls(6, max_weight=50.0, self_normalize=self_normalize)(x, cand.to(where), chosen.to(where),
                                                                             rewards.to(where), logged.to(where))
        results.append((loss, *torch.autograd.grad(loss, x)))
    for got, want in zip(results[1], results[0]):
        _assert_same(got, want, scale=50.0)


def test_a_cpu_scalar_baseline_broadcasts_onto_the_device(device):
    """As torch broadcasts a 0-dim CPU tensor onto any device, so does the losses' scalar baseline (found by
    review: it was expanded on the CPU and then met the device's rewards)."""
    logits, cand, chosen, rewards = (t.to(device) for t in _inputs(1, torch.float32, seed=15))
    loss_fn = CAPGLoss(6)
    want = loss_fn(logits, cand, chosen, rewards, baseline=torch.full((5,), 0.3, device=device))
    for scalar in (torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64), 0.3):
        torch.testing.assert_close(loss_fn(logits, cand, chosen, rewards, baseline=scalar), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA's host syncs")
@pytest.mark.parametrize("name", ["vpg", "vpg_swr", "with_replacement", "mean_field", "plugin"])
@pytest.mark.parametrize("num_experts", [1, 3])
def test_input_checks_wait_for_cuda_once(name, num_experts):
    """A loss's input checks read their results back in one sync (a profile on an H200 found 3 to 5: the expert
    blocks' needs were made from Python lists on the device, and the counts indexed by lists). Mean-field's root
    solve waits for its own convergence tests, as many with the checks as without."""
    device = torch.device("cuda")
    logits, cand, chosen, rewards = (t.to(device) for t in _inputs(num_experts, torch.float32, seed=16))
    logits.requires_grad_()

    def syncs(validate: bool) -> int:
        loss_fn = VPGLoss(6, with_replacement=name == "vpg_swr", validate_args=validate) if name.startswith("vpg") \
            else CAPGLoss(6, method=name, validate_args=validate)
        loss_fn(logits, cand, chosen, rewards).backward()  # constants made once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                loss_fn(logits, cand, chosen, rewards).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message).lower() for w in seen)

    assert syncs(True) - syncs(False) == 1


@pytest.mark.parametrize("method", ["exact", "mean_field", "plugin"])
def test_logged_propensities_agree_with_the_cpu(device, method):
    logits, cand, chosen, _ = _inputs(2, torch.float64, seed=6)
    on = [log_propensities(logits.to(w), cand.to(w), chosen.to(w), method=method, temperature=2.0, epsilon=0.1)
          for w in (CPU, device)]
    for got, want in zip(on[1], on[0]):
        _assert_same(got, want, scale=20.0)


def test_off_policy_value_agrees_with_the_cpu(device):
    g = torch.Generator().manual_seed(6)
    logged = torch.rand(400, 3, generator=g, dtype=torch.float64).log()
    target = (logged + 0.3 * torch.randn(400, 3, generator=g, dtype=torch.float64)).clamp(max=0.0)
    rewards = torch.rand(400, 3, generator=g, dtype=torch.float64)
    estimates = [off_policy_value(target.to(w), logged.to(w), rewards.to(w), max_weight=20.0).to_dict()
                 for w in (CPU, device)]
    assert estimates[0]["effective_sample_size"] > 10  # intervals are numbers
    torch.testing.assert_close(estimates[1], estimates[0], rtol=1e-9, atol=1e-12)


def test_greedy_and_candidate_log_prob_agree_with_the_cpu(device):
    logits, cand, _, _ = _inputs(2, torch.float64, seed=7)
    greedy = [greedy_candidates(logits.to(w), 6) for w in (CPU, device)]
    assert torch.equal(greedy[1].cpu(), greedy[0])
    _assert_same(candidate_log_prob(logits.to(device), cand.to(device)), candidate_log_prob(logits, cand), 20.0)


@pytest.mark.parametrize("temperature, epsilon", [(1.0, 0.0), (2.0, 0.0), (1.0, 0.3)])
@pytest.mark.parametrize("num_experts", [1, 2])
def test_draws_on_the_device_follow_the_exact_inclusion_probabilities(device, num_experts, temperature, epsilon):
    """Inclusion counts of 20,000 draws made with the device's generator, against the exact-enumeration
    probabilities of the exploration mixture, in binomial acceptance regions (Bonferroni, α = 1e-6); the
    first position against its softmax."""
    g = torch.Generator().manual_seed(8)
    n, k = 20_000, 3
    logits = torch.randn(num_experts, 6, generator=g, dtype=torch.float64) * 1.5
    logits[..., 5] = float("-inf")
    rows = logits.expand(n, num_experts, 6).squeeze(1).to(device)
    gen = torch.Generator(device).manual_seed(9)
    draws = explore_candidates(rows, k, temperature=temperature, epsilon=epsilon, generator=gen).cpu()
    assert draws.device.type == "cpu" and (draws != 5).all()
    scaled = (logits / temperature).reshape(1, num_experts, 6)
    experts = expert_of_position(k, num_experts)
    uniform = torch.tensor([k / 5] * 5 + [0.0], dtype=torch.float64)
    probs = (1 - epsilon) * inclusion_probs(scaled, experts)[0] + epsilon * uniform
    counts = torch.zeros(6, dtype=torch.float64).index_add_(0, draws.flatten(), torch.ones(n * k, dtype=torch.float64))
    assert_counts_match(counts.numpy(), probs.numpy(), n)
    first = (1 - epsilon) * scaled[0, 0].softmax(-1) + epsilon * uniform / k
    assert_counts_match(np.bincount(draws[:, 0].numpy(), minlength=6).astype(float), first.numpy(), n)


@pytest.fixture
def deterministic(monkeypatch):
    """``torch.use_deterministic_algorithms(True)``, as a user who wants reproducible runs sets it (with the cuBLAS
    workspace setting that CUDA's deterministic matrix products ask for)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("placement", ["logits", "chunked", "sampled"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_deterministic_algorithms_run_and_repeat_bit_for_bit(device, name, placement, deterministic):
    """Under deterministic algorithms every loss runs (none of its ops is one that CUDA refuses there) and two
    runs give the same bits, values and gradients."""
    g = torch.Generator().manual_seed(10)
    user = torch.randn(4, 2, 8, generator=g, dtype=torch.float32).to(device).requires_grad_()
    item = torch.randn(300, 2, 8, generator=g, dtype=torch.float32).to(device).requires_grad_()
    cand = sample_candidates(EmbeddingCatalog(user.detach(), item.detach()), 6,
                             generator=torch.Generator(device).manual_seed(11))
    chosen, rewards = cand[:, :2], torch.rand(4, 2, generator=g).to(device)
    sampler = MixedSampler(UniformSampler(32), InBatchSampler(num_buckets=256))
    ids = sampler.draw(300, cand, generator=torch.Generator(device).manual_seed(12), device=device)

    def run():
        if placement == "logits":
            catalog = torch.einsum("bmd,nmd->bmn", user, item)
        elif placement == "chunked":
            catalog = EmbeddingCatalog(user, item, chunk_size=64)
        else:
            catalog = SampledCatalog(user, item, sampler=DrawnSample(ids, sampler), head_items=cand,
                                     index=ExactIndex(item.detach()), head_size=8)
        loss = _loss(name, 6)(catalog, cand, chosen, rewards)
        return (loss, *torch.autograd.grad(loss, (user, item)))

    for first, second in zip(run(), run()):
        assert torch.equal(first, second)


@pytest.mark.parametrize("method", ["exact", "mean_field", "plugin"])
def test_logging_and_off_policy_losses_run_under_deterministic_algorithms(device, method, deterministic):
    logits, _, _, rewards = _inputs(2, torch.float32, seed=13)
    logits = logits.to(device).requires_grad_()
    cand = explore_candidates(logits.detach(), 6, temperature=2.0, epsilon=0.2,
                              generator=torch.Generator(device).manual_seed(14))
    chosen, rewards = cand[:, [4, 0, 2]], rewards.to(device)

    def run():
        logged = log_propensities(logits.detach() * 0.5, cand, chosen, method=method, epsilon=0.2)
        loss = OffPolicyCAPGLoss(6, method=method, max_weight=20.0)(logits, cand, chosen, rewards,
                                                                     logged.log_inclusion)
        return (*logged, loss, *torch.autograd.grad(loss, logits))

    for first, second in zip(run(), run()):
        assert torch.equal(first, second)
