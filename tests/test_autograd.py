"""Second derivatives and torch.func transforms of the custom autograd Functions, against plain autograd.

Outputs that are ``-inf`` (masked entries) are replaced by 0 before they enter a loss, so that finite
differences and the references are defined; the Functions must then give those entries exactly zero
first and second derivatives.
"""

import math

import pytest
import torch

from capg_rec._numerics import filled_logsumexp, gather_with_rest, log_softmax_at
from capg_rec.catalog import _chunked_top_k, _ChunkedLogPowerSums

SHAPE = (3, 4, 5)


def _finite(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _case(dim: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x`` of SHAPE with scattered ``-inf`` entries and one all-``-inf`` slice along ``dim``, and
    ids along ``dim`` with a repeat in every slice; one slice names every entry (its rest is empty).
    Drawn on the CPU (the same case on every device), returned on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    x[torch.rand(SHAPE, generator=gen) < 0.15] = -math.inf
    x.movedim(dim, -1)[0, 0] = -math.inf
    n = SHAPE[dim]
    index = torch.randint(0, n, tuple(n + 1 if d == dim % len(SHAPE) else s for d, s in enumerate(SHAPE)),
                          generator=gen)
    index.select(dim, 1).copy_(index.select(dim, 0))
    index.movedim(dim, -1)[-1, -1] = torch.cat([torch.arange(n), torch.zeros(1, dtype=torch.long)])
    return x.to(device).requires_grad_(), index.to(device)


def _ours(name, x, index, dim):
    if name == "logsumexp":
        return (filled_logsumexp(x, dim),)
    if name == "log_softmax_at":
        return (log_softmax_at(x, index, dim),)
    return gather_with_rest(x, index, dim)


def _logsumexp(x, dim):
    """torch.logsumexp, with -inf and a zero gradient (not NaN) where a slice is all -inf."""
    empty = (x == -math.inf).all(dim, keepdim=True)
    return torch.logsumexp(x.masked_fill(empty, 0.0), dim).masked_fill(empty.squeeze(dim), -math.inf)


def _reference(name, x, index, dim):
    if name == "logsumexp":
        return (_logsumexp(x, dim),)
    if name == "log_softmax_at":
        empty = (x == -math.inf).all(dim, keepdim=True)
        return (torch.log_softmax(x.masked_fill(empty, 0.0), dim).masked_fill(empty, -math.inf).gather(dim, index),)
    named = torch.zeros_like(x, dtype=torch.bool).scatter(dim, index, True)
    return x.gather(dim, index), _logsumexp(x.masked_fill(named, -math.inf), dim)


def _loss(outputs, weights):
    """A loss with a nonzero second derivative in each output: Σ w·f + Σ f²/2 (f with -inf → 0)."""
    return sum((w * _finite(f) + _finite(f) ** 2 / 2).sum() for f, w in zip(outputs, weights))


def _weights(outputs, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(f.shape, generator=gen, dtype=f.dtype).to(f.device) for f in outputs]


def _randn(shape, seed: int, device: torch.device) -> torch.Tensor:
    """float64 standard normals drawn on the CPU, on ``device``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)


FUNCTIONS = ["logsumexp", "log_softmax_at", "gather_with_rest"]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_gradcheck_and_gradgradcheck_with_masked_entries(name, dim, device):
    """First and second derivatives equal finite differences, with -inf entries, all-(-inf) slices,
    slices whose rest is empty and repeated ids."""
    x, index = _case(dim, seed=10 + dim, device=device)

    def f(t):
        return tuple(_finite(o) for o in _ours(name, t, index, dim))

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_hvp_matches_plain_autograd(name, dim, device):
    """Hessian-vector products through a loss equal those of torch.logsumexp / log_softmax (masked
    entries and slices included)."""
    x, index = _case(dim, seed=20 + dim, device=device)
    weights = _weights(_ours(name, x, index, dim), seed=dim)
    v = _randn(SHAPE, 3, device)
    got = torch.autograd.functional.hvp(lambda t: _loss(_ours(name, t, index, dim), weights), x, v)
    ref = torch.autograd.functional.hvp(lambda t: _loss(_reference(name, t, index, dim), weights), x, v)
    assert float(ref[1].abs().max()) > 0.1  # a real second derivative
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    vhp = torch.autograd.functional.vhp(lambda t: _loss(_ours(name, t, index, dim), weights), x, v)[1]
    torch.testing.assert_close(vhp, ref[1])


@pytest.mark.parametrize("name", FUNCTIONS)
def test_masked_entries_have_zero_first_and_second_derivatives(name, device):
    """-inf entries, all-(-inf) slices and empty rests: exactly zero gradient and Hessian rows, no NaN."""
    x, index = _case(2, seed=30, device=device)
    outputs = _ours(name, x, index, 2)
    weights = [1e8 * w for w in _weights(outputs, seed=1)]  # large upstream gradients
    (grad,) = torch.autograd.grad(_loss(outputs, weights), x, create_graph=True)
    v = _randn(SHAPE, 4, device)
    (hvp,) = torch.autograd.grad(grad, x, v)
    masked = x.detach() == -math.inf
    assert bool(torch.isfinite(grad).all()) and bool(torch.isfinite(hvp).all())
    assert bool((grad[masked] == 0).all()) and bool((hvp[masked] == 0).all())
    if name == "logsumexp":
        assert outputs[0][0, 0] == -math.inf
    if name == "gather_with_rest":
        assert outputs[1][-1, -1] == -math.inf


@pytest.mark.parametrize("name", FUNCTIONS)
def test_torch_func_grad_vmap_and_jacrev(name, device):
    """torch.func.grad, vmap(grad) and jacrev agree with plain-autograd references."""
    x, index = _case(1, seed=40, device=device)
    x = x.detach()
    weights = _weights(_ours(name, x, index, 1), seed=2)

    def loss(fn):
        return lambda t: _loss(fn(name, t, index, 1), weights)

    torch.testing.assert_close(torch.func.grad(loss(_ours))(x), torch.func.grad(loss(_reference))(x))
    batch = torch.stack([x, x * 0.5, x + 1.0])
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(loss(_ours)))(batch),
                               torch.func.vmap(torch.func.grad(loss(_reference)))(batch))

    def outputs(fn):
        return lambda t: tuple(_finite(o) for o in fn(name, t, index, 1))

    torch.testing.assert_close(torch.func.jacrev(outputs(_ours))(x), torch.func.jacrev(outputs(_reference))(x))
    torch.testing.assert_close(torch.func.jacrev(torch.func.grad(loss(_ours)))(x),
                               torch.func.jacrev(torch.func.grad(loss(_reference)))(x))


def test_the_fused_functions_compile_without_graph_breaks(device):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    index = torch.tensor([[0, 0], [1, 2], [5, 3], [4, 4]], device=device)

    def f(t):
        named, rest = gather_with_rest(t, index, 1)
        return (filled_logsumexp(t, 1).sum() + log_softmax_at(t, index, 1).sum() + named.sum() + rest.sum())

    out = torch.compile(f, fullgraph=True, backend="eager")(x)
    (grad,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(grad, torch.autograd.grad(f(x), x)[0])


# ---- the streamed (embedding) power sums ----------------------------------------------------------

N_ITEMS = 13
EXCLUDE = torch.tensor([[0, 5, 12, -1, -1], [3, 3, 4, 7, -1], [-1, -1, -1, -1, -1]])  # padded, repeated ids


def _embeddings(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 user ``[3, 2, 4]`` and item ``[N_ITEMS, 2, 4]`` leaves and EXCLUDE, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    user = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    item = torch.randn(N_ITEMS, 2, 4, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    return user, item, EXCLUDE.to(device)


def _dense_power_sums(user, item, exclude, num_powers):
    s = torch.einsum("bmd,nmd->bmn", user, item)
    spare = torch.where(exclude >= 0, exclude, N_ITEMS)
    excluded = torch.zeros(user.shape[0], N_ITEMS + 1, dtype=torch.bool, device=user.device)
    excluded = excluded.scatter(1, spare, True)[:, :N_ITEMS]
    s = s.masked_fill(excluded.unsqueeze(1), -math.inf)
    return torch.stack([torch.logsumexp(p * s, 2) for p in range(1, num_powers + 1)], -1)


def _chunked(user, item, exclude, num_powers, chunk_size):
    return _ChunkedLogPowerSums.apply(user, item, exclude, num_powers, chunk_size)


@pytest.mark.parametrize("num_powers", [1, 2, 4])
@pytest.mark.parametrize("chunk_size", [1, 5, 20])
def test_chunked_gradcheck_and_gradgradcheck(num_powers, chunk_size, device):
    """Chunks that do not divide N (and one chunk for all), exclusions with padding and repeats, and a
    row whose items are all excluded (-inf, zero derivatives)."""
    user, item, exclude = _embeddings(50, device)
    exclude = torch.cat([torch.nn.functional.pad(exclude, (0, N_ITEMS - exclude.shape[1]), value=-1),
                         torch.arange(N_ITEMS, device=device).unsqueeze(0)])
    user = torch.cat([user, user[:1]]).detach().requires_grad_()

    def f(u, v):
        return _finite(_chunked(u, v, exclude, num_powers, chunk_size))

    assert torch.autograd.gradcheck(f, (user, item))
    assert torch.autograd.gradgradcheck(f, (user, item))


@pytest.mark.parametrize("num_powers", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk_size", [3, 5])
def test_chunked_hvp_matches_dense(num_powers, chunk_size, device):
    user, item, exclude = _embeddings(60 + num_powers, device)
    weights = _weights([torch.zeros(3, 2, num_powers, dtype=torch.float64, device=device)], seed=num_powers)

    def loss(fn):
        return lambda u, v: _loss([fn(u, v)], weights)

    ours = loss(lambda u, v: _chunked(u, v, exclude, num_powers, chunk_size))
    ref = loss(lambda u, v: _dense_power_sums(u, v, exclude, num_powers))
    vecs = (_randn(user.shape, 5, device), _randn(item.shape, 6, device))
    got = torch.autograd.functional.hvp(ours, (user, item), vecs)
    want = torch.autograd.functional.hvp(ref, (user, item), vecs)
    assert float(want[1][0].abs().max()) > 0.1
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.functional.vhp(ours, (user, item), vecs), want)


def test_chunked_torch_func_grad_vmap_and_jacrev(device):
    user, item, exclude = _embeddings(70, device)
    user, item = user.detach(), item.detach()
    weights = _weights([torch.zeros(3, 2, 3, dtype=torch.float64, device=device)], seed=7)

    def loss(fn):
        return lambda u, v: _loss([fn(u, v)], weights)

    ours = loss(lambda u, v: _chunked(u, v, exclude, 3, 5))
    ref = loss(lambda u, v: _dense_power_sums(u, v, exclude, 3))
    both = (0, 1)
    torch.testing.assert_close(torch.func.grad(ours, both)(user, item), torch.func.grad(ref, both)(user, item))
    users = torch.stack([user, 0.5 * user])
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(ours, both), (0, None))(users, item),
                               torch.func.vmap(torch.func.grad(ref, both), (0, None))(users, item))
    torch.testing.assert_close(torch.func.jacrev(lambda u, v: _chunked(u, v, exclude, 3, 5), both)(user, item),
                               torch.func.jacrev(lambda u, v: _dense_power_sums(u, v, exclude, 3), both)(user, item))
    torch.testing.assert_close(torch.func.jacrev(torch.func.grad(ours))(user, item),
                               torch.func.jacrev(torch.func.grad(ref))(user, item))


def test_chunked_functions_compile_without_graph_breaks_when_not_checking(device):
    """check_finite=False: no host sync, so the streamed reductions trace as one graph."""
    user, item, exclude = _embeddings(80, device)

    def f(u, v):
        return _ChunkedLogPowerSums.apply(u, v, exclude, 2, 5, False).sum()

    out = torch.compile(f, fullgraph=True, backend="eager")(user, item)
    torch.testing.assert_close(torch.autograd.grad(out, (user, item)), torch.autograd.grad(f(user, item), (user, item)))

    def top(u, v):
        return _chunked_top_k(u, v, 3, exclude, None, 5, check_finite=False)[1]

    assert torch.equal(torch.compile(top, fullgraph=True, backend="eager")(user, item), top(user, item))


def test_vmap_with_checks_on_or_the_exact_method_says_why_it_cannot_run():
    """Under torch.func.vmap the value checks (they read values) and the exact method (data-dependent sizes)
    raise a RuntimeError that says so, instead of vmap's own error from deep inside; checks off, every
    other method runs and equals the loop."""
    import capg_rec

    x = torch.randn(3, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cand = torch.tensor([[0, 1], [2, 3], [1, 4], [5, 0]])
    rewards = torch.ones(4, 1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="validate_args=False inside vmap"):
        torch.func.vmap(lambda row: capg_rec.CAPGLoss(2)(row, cand, cand[:, :1], rewards))(x)
    with pytest.raises(RuntimeError, match="validate_args=False inside vmap"):
        torch.func.vmap(lambda row: capg_rec.inclusion_log_prob(row, cand, 2))(x)
    with pytest.raises(RuntimeError, match="exact method does not run under torch.func.vmap"):
        torch.func.vmap(lambda row: capg_rec.inclusion_log_prob(row, cand, 2, method="exact", validate_args=False))(x)
    for method in ("mean_field", "plugin", "with_replacement"):
        loss = capg_rec.CAPGLoss(2, method=method, validate_args=False)
        batched = torch.func.vmap(lambda row: loss(row, cand, cand[:, :1], rewards))(x)
        torch.testing.assert_close(batched, torch.stack([loss(row, cand, cand[:, :1], rewards) for row in x]))


def test_vmap_over_the_ids_of_shared_scores():
    """vmap over several draws (or users) of scores that are not batched themselves: the CPU fast paths wrote
    batched values in place into unbatched buffers (vmap's 'scatter_ is not possible'). Values and gradients
    now equal the loop; the plug-in's gradient there says it does not run (once made to run, it counted the
    softmax part once per vmapped draw)."""
    import capg_rec

    g = torch.Generator().manual_seed(0)
    for experts in (1, 2):
        logits = torch.randn(3, experts, 12, generator=g, dtype=torch.float64).squeeze(1)
        draws = torch.stack([capg_rec.sample_candidates(logits, 4, generator=g) for _ in range(4)])  # [S, B, K]
        rewards = torch.rand(4, 3, 2, generator=g, dtype=torch.float64)
        losses = [capg_rec.VPGLoss(4, validate_args=False), capg_rec.VPGLoss(4, with_replacement=True,
                                                                             validate_args=False),
                  *(capg_rec.CAPGLoss(4, method=m, validate_args=False) for m in ("mean_field", "with_replacement",
                                                                                   "plugin"))]
        for loss in losses:
            x = logits.clone().requires_grad_()
            loop = torch.stack([loss(x, c, c[:, [3, 0]], r) for c, r in zip(draws, rewards)])
            mapped = torch.func.vmap(lambda c, r: loss(x, c, c[:, [3, 0]], r))(draws, rewards)
            torch.testing.assert_close(mapped, loop)
            if isinstance(loss, capg_rec.CAPGLoss) and loss.method.__class__.__name__ == "PlugIn":
                with pytest.raises(RuntimeError, match="expand the scores over the vmapped dimension"):
                    torch.autograd.grad(mapped.sum(), x)
                continue
            torch.testing.assert_close(torch.autograd.grad(mapped.sum(), x)[0], torch.autograd.grad(loop.sum(), x)[0])
    users = torch.randn(3, 2, 4, 5, generator=g, dtype=torch.float64)  # vmap over [B=2, M=4, D=5] user batches
    item = torch.randn(2100, 4, 5, generator=g, dtype=torch.float64)  # streamed in chunks: the exclusion masks
    cand = capg_rec.sample_candidates(torch.einsum("bmd,nmd->bmn", users[0], item), 6, generator=g)
    for method in ("mean_field", "plugin", "with_replacement"):
        loss = capg_rec.CAPGLoss(6, method=method, validate_args=False)

        def one(u):
            return loss(capg_rec.EmbeddingCatalog(u, item, validate_args=False), cand, cand[:, :2], torch.ones(2, 2))

        torch.testing.assert_close(torch.func.vmap(one)(users), torch.stack([one(u) for u in users]))


def _hvp(fn, x):
    """Hessian-vector product of the scalar ``fn(x)`` with ones, by double backward."""
    x = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(fn(x), x, create_graph=True)
    return torch.autograd.grad(grad.sum(), x)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_second_derivatives_stay_finite_for_confident_policies(dtype):
    """Regressions (found by review), each a NaN or inf Hessian where the value is smooth:
    - mean-field (the default): a target nearly sure to be drawn, whose _LogHit slope x / (e^x - 1) overflowed;
    - V-PG and the plug-in: a draw's suffix ~400 nats below the row's best, whose float64 suffix sums' log had
      -g / total² overflow (reverse_logcumsumexp's fast path now stops at 300 nats);
    - enumerate: a probability below ~1e-154, the log of a linear sum."""
    import capg_rec.functional as F
    from capg_rec import candidate_log_prob, inclusion_log_prob

    g = torch.Generator().manual_seed(0)
    logits = (3.0 * torch.randn(4, 1000, generator=g)).to(dtype)
    chosen = logits.topk(8, dim=1).indices  # nearly certain to be drawn
    candidates = torch.cat([chosen, logits.topk(50, dim=1).indices[:, 8:]], 1)
    rewards = torch.rand(4, 8, generator=g, dtype=dtype)
    hvp = _hvp(lambda x: F.capg_loss(x, candidates, chosen, rewards), logits)
    assert torch.isfinite(hvp).all()
    far = torch.tensor([[0.0, -400.0, -410.0, -420.0]], dtype=dtype)
    assert torch.isfinite(_hvp(lambda x: candidate_log_prob(x, torch.tensor([[0, 1]])).sum(), far)).all()
    five = torch.tensor([[0.0, -400.0, -410.0, -420.0, -430.0]], dtype=dtype)
    targets = torch.arange(5).unsqueeze(0)
    assert torch.isfinite(_hvp(lambda x: inclusion_log_prob(x, targets, 3, method="plugin").sum(), five)).all()
    wide = torch.tensor([[0.0, -200.0, -400.0, -1.0, -2.0]], dtype=torch.float64)
    assert torch.isfinite(_hvp(lambda x: inclusion_log_prob(x, targets, 2, method="enumerate").sum(), wide)).all()


def test_mean_field_of_one_draw_is_the_softmax():
    """Regression (found by review): at K = 1 mean-field solved Rosén's equation, 1 - exp(-e^{s - κ}), off the
    softmax by up to 12% (N = 1000, logits of sd 3): CAPGLoss(1) was not REINFORCE. One draw is the softmax, exactly."""
    from capg_rec import inclusion_log_prob

    logits = 3.0 * torch.randn(2, 1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    items = torch.tensor([[0, 5, 999], [1, 2, 3]])
    torch.testing.assert_close(inclusion_log_prob(logits, items, 1, method="mean_field"),
                               torch.log_softmax(logits, 1).gather(1, items), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("method", ["mean_field", "plugin", "with_replacement", "exact"])
def test_forward_mode_raises_not_implemented_or_is_right(method, m):
    """The README: forward mode is not supported by the custom autograd Functions (NotImplementedError). The exact
    method for a mixture gave functorch's internal RuntimeError (requires_grad_ inside a transform); for one expert
    it has no custom Function and its jvp is the directional derivative."""
    import capg_rec
    from capg_rec import functional as F

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, m, 10, dtype=torch.float64, generator=gen).squeeze(1)
    candidates = capg_rec.sample_candidates(logits, 3, generator=gen)
    rewards = torch.ones(4, 1, dtype=torch.float64)
    direction = torch.randn(logits.shape, dtype=torch.float64, generator=gen)

    def loss(x):
        return F.capg_loss(x, candidates, candidates[:, :1], rewards, method=method, validate_args=False)

    def dual(x, v):  # torch.autograd.forward_ad: the mixture's tangents were silently wrong (found by review)
        with torch.autograd.forward_ad.dual_level():
            return torch.autograd.forward_ad.unpack_dual(loss(torch.autograd.forward_ad.make_dual(x, v))).tangent

    if method == "exact" and m == 1:
        (grad,) = torch.autograd.grad(loss(logits.requires_grad_()), logits)
        _, tangent = torch.func.jvp(loss, (logits.detach(),), (direction,))
        torch.testing.assert_close(tangent, (grad * direction).sum())
        torch.testing.assert_close(dual(logits.detach(), direction), (grad * direction).sum())
    else:
        with pytest.raises(NotImplementedError):
            torch.func.jvp(loss, (logits.detach(),), (direction,))
        with pytest.raises(NotImplementedError):
            dual(logits.detach(), direction)


@pytest.mark.parametrize("loss", ["vpg", "capg_mean_field", "capg_plugin", "capg_with_replacement"])
def test_nested_torch_func_grad_on_a_fresh_cache(loss, device):
    """grad of grad (a Hessian-vector product) of a mixture's loss, twice, when the first call is what fills the
    library's caches of constant tensors: the second call failed (an internal functorch assert), because a tensor
    cached inside the transform outlived its level (found by review). Both agree with plain double backward."""
    import capg_rec
    from capg_rec import _numerics, marginals, plackett_luce

    F = capg_rec.functional
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 12, generator=g, dtype=torch.float64).to(device)
    cand = capg_rec.sample_candidates(x, 5, generator=g) if device.type == "cpu" else \
        capg_rec.sample_candidates(x.cpu(), 5, generator=g).to(device)
    chosen, rewards, v = cand[:, :2], torch.randn(3, 2, dtype=torch.float64, device=device), torch.randn_like(x)
    method = loss.removeprefix("capg_")

    def f(y):
        if loss == "vpg":
            return F.vpg_loss(y, cand, chosen, rewards)
        return F.capg_loss(y, cand, chosen, rewards, method=method)

    leaf = x.clone().requires_grad_()
    (first,) = torch.autograd.grad(f(leaf), leaf, create_graph=True)
    (want,) = torch.autograd.grad((first * v).sum(), leaf)
    for cached in (plackett_luce._expert_index, plackett_luce._block_positions, _numerics.position_index,
                   marginals._log_counts):
        cached.cache_clear()
    for _ in range(2):
        torch.testing.assert_close(torch.func.grad(lambda z: (torch.func.grad(f)(z) * v).sum())(x), want)


def test_constant_caches_filled_under_inference_mode_serve_a_later_backward():
    """A mixture's plug-in loss first called under torch.inference_mode, then trained: the cached constant tensors
    were inference tensors, which the backward could not save (found by review)."""
    import capg_rec
    from capg_rec import _numerics, marginals, plackett_luce

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 12, generator=g, dtype=torch.float64)
    cand = capg_rec.sample_candidates(x, 5, generator=g)
    rewards = torch.rand(3, 2, dtype=torch.float64, generator=g)
    for cached in (plackett_luce._expert_index, plackett_luce._block_positions, _numerics.position_index,
                   marginals._log_counts):
        cached.cache_clear()
    for method in ("plugin", "mean_field", "with_replacement"):
        with torch.inference_mode():
            capg_rec.functional.capg_loss(x, cand, cand[:, :2], rewards, method=method)
        leaf = x.clone().requires_grad_()
        capg_rec.functional.capg_loss(leaf, cand, cand[:, :2], rewards, method=method).backward()
        assert torch.isfinite(leaf.grad).all()
    with torch.inference_mode():
        capg_rec.functional.vpg_loss(x, cand, cand[:, :2], rewards)
    leaf = x.clone().requires_grad_()
    capg_rec.functional.vpg_loss(leaf, cand, cand[:, :2], rewards).backward()
