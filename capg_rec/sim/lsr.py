"""Late-stage rankers (LSR): pick L of the K candidates the ESR retrieved.

An LSR is any callable ``lsr(scores, num_outputs, generator) -> (picks, propensities)``:

* ``scores [B, K]``: the environment's ranking scores of the candidates (``MatrixEnv.lsr_scores``),
* ``picks [B, L]``: positions in the candidate list (``0..K-1``, distinct per row), ranked,
* ``propensities [B, L]`` or ``None``: ``π(pick_l | earlier picks)``, the probability of the l-th
  pick given the earlier ones (the Plackett-Luce factor; 1 for a deterministic ranker). Their
  product is the probability of the ranking.

The built-in rankers also give ``expected_value(scores, q, num_outputs) → [B]``: the exact
``E[mean_l q(a_l)]`` under the ranker, which the trainer's evaluation uses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from capg_rec._checks import check_count, check_positive
from capg_rec._numerics import gumbel_like
from capg_rec.catalog import resolution

__all__ = ["LSRPolicy", "OptimalLSR", "AntiOptimalLSR", "NoisyLSR", "UniformLSR", "make_lsr", "LSR_NAMES"]

LSRPolicy = Callable[[Tensor, int, torch.Generator | None], tuple[Tensor, Tensor | None]]


def _check(scores: Tensor, num_outputs: int, q: Tensor | None = None) -> None:
    """The arguments of a ranker (and of its ``expected_value``, whose ``q`` holds a value per candidate)."""
    if not isinstance(scores, Tensor) or not scores.is_floating_point():
        raise TypeError(f"scores must be a float tensor [B, K], got {getattr(scores, 'dtype', type(scores).__name__)}")
    if scores.dim() != 2:
        raise ValueError(f"scores must have shape [B, K], got {list(scores.shape)}")
    check_count("num_outputs", num_outputs, high=scores.shape[1])
    if scores.numel() and not bool((scores < torch.inf).all()):  # NaN or +inf: no ranking (NaN fails <)
        raise ValueError("scores must not hold NaN or +inf")
    if q is not None:
        if not isinstance(q, Tensor) or not q.is_floating_point():
            raise TypeError(f"q must be a float tensor [B, K], got {getattr(q, 'dtype', type(q).__name__)}")
        if q.shape != scores.shape:
            raise ValueError(f"q must have the shape of scores {list(scores.shape)}, got {list(q.shape)}")
        if q.numel() and not bool(torch.isfinite(q).all()):  # a value, not a ranking: -inf is no value either
            raise ValueError("q must be finite (no NaN or inf)")


def _pl_factors(scores: Tensor, picks: Tensor) -> Tensor:
    """Log Plackett-Luce factors ``log π(pick_l | earlier)`` of ranked picks → ``[B, L]``."""
    available = torch.ones_like(scores, dtype=torch.bool)
    out = []
    for l in range(picks.shape[1]):
        pick = picks[:, l : l + 1]
        log_norm = torch.logsumexp(scores.masked_fill(~available, -torch.inf), dim=1, keepdim=True)
        out.append(scores.gather(1, pick) - log_norm)
        available = available.scatter(1, pick, False)
    return torch.cat(out, dim=1)


class OptimalLSR:
    """The oracle ranker: the top-L candidates by score (propensities 1).

    Shape:
        ``scores [B, K]`` → ``picks [B, L]`` (positions in ``0..K-1``), ``propensities [B, L]``;
        :meth:`expected_value`: ``scores, q [B, K]`` → ``[B]``.

    Example:
        >>> picks, propensities = OptimalLSR()(torch.tensor([[0.1, 0.9, 0.5, 0.3]]), 2)
        >>> picks, propensities
        (tensor([[1, 2]]), tensor([[1., 1.]]))
    """

    sign = 1.0

    def __call__(self, scores: Tensor, num_outputs: int, generator: torch.Generator | None = None
                 ) -> tuple[Tensor, Tensor]:
        _check(scores, num_outputs)
        picks = self._picks(scores, num_outputs)
        return picks, torch.ones(picks.shape, dtype=scores.dtype, device=scores.device)

    def expected_value(self, scores: Tensor, q: Tensor, num_outputs: int) -> Tensor:
        _check(scores, num_outputs, q)
        return q.gather(1, self._picks(scores, num_outputs)).mean(dim=1)

    def _picks(self, scores: Tensor, num_outputs: int) -> Tensor:
        """The L candidates it ranks first (checked arguments)."""
        return (self.sign * scores).topk(num_outputs, dim=1).indices

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AntiOptimalLSR(OptimalLSR):
    """The anti-oracle: the bottom-L candidates by score (propensities 1).

    Shape:
        ``scores [B, K]`` → ``picks [B, L]`` (positions in ``0..K-1``), ``propensities [B, L]``;
        :meth:`expected_value`: ``scores, q [B, K]`` → ``[B]``.

    Example:
        >>> picks, propensities = AntiOptimalLSR()(torch.tensor([[0.1, 0.9, 0.5, 0.3]]), 2)
        >>> picks, propensities
        (tensor([[0, 3]]), tensor([[1., 1.]]))
    """

    sign = -1.0


class NoisyLSR:
    """Plackett-Luce over the candidates with ``softmax(scores / τ)``, without replacement.

    The paper's "noisy-optimal" ranker is ``τ = 1`` on the synthetic ``q_raw``.

    Args:
        temperature: τ > 0 (default 1.0); propensities are the Plackett-Luce factors ``π(pick_l | earlier picks)``.

    Shape:
        ``scores [B, K]`` → ``picks [B, L]`` (positions in ``0..K-1``), ``propensities [B, L]``;
        :meth:`expected_value`: ``scores, q [B, K]`` → ``[B]``.

    Example:
        >>> scores = torch.randn(3, 10)
        >>> picks, propensities = NoisyLSR(temperature=0.5)(scores, 2)
        >>> picks.shape, bool(((propensities > 0) & (propensities <= 1)).all())
        (torch.Size([3, 2]), True)
        >>> NoisyLSR().expected_value(scores, torch.rand(3, 10), 2).shape
        torch.Size([3])
    """

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = check_positive("temperature", temperature)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(temperature={self.temperature})"

    def _scaled(self, scores: Tensor, num_outputs: int, q: Tensor | None = None) -> Tensor:
        """:func:`_check`'d ``scores / τ``, which must stay below ``+inf`` and hold L entries above ``-inf`` in every
        row (a draw by softmax never reaches the others): checked after the division, which a small τ overflows."""
        _check(scores, num_outputs, q)
        s = scores / self.temperature
        if s.numel() and not bool((s < torch.inf).all()):
            raise ValueError(f"scores / temperature must stay finite or -inf, but temperature={self.temperature:g} "
                             f"takes a score to +inf")
        if s.numel() and not bool(((s > -torch.inf).sum(1) >= num_outputs).all()):
            raise ValueError(f"scores / temperature must hold num_outputs={num_outputs} entries above -inf in every "
                             f"row (temperature={self.temperature:g}): NoisyLSR draws by softmax, which never picks "
                             "a -inf one")
        return s

    def __call__(self, scores: Tensor, num_outputs: int, generator: torch.Generator | None = None
                 ) -> tuple[Tensor, Tensor]:
        s = self._scaled(scores, num_outputs)
        noise = gumbel_like(tuple(s.shape), generator=generator, dtype=s.dtype, device=s.device)
        picks = (s + noise).topk(num_outputs, dim=1).indices
        return picks, _pl_factors(s, picks).exp()

    def expected_value(self, scores: Tensor, q: Tensor, num_outputs: int) -> Tensor:
        s = self._scaled(scores, num_outputs, q)
        if num_outputs == 1:
            return (torch.softmax(s, dim=1) * q).sum(dim=1)
        from capg_rec.marginals import inclusion_log_prob  # mean over positions = Σ_a q(a) P(a in top-L) / L

        items = torch.arange(s.shape[1], device=s.device).expand(s.shape[0], -1)
        finite = s.detach()[s > -torch.inf]
        spread = float(finite.max() - finite.min()) if finite.numel() else 0.0
        # in float64 where a small τ spreads the scores beyond the dtype's resolution (greedy in the limit)
        work = s if spread <= resolution(s.dtype) else s.double()
        try:
            inclusion = inclusion_log_prob(work, items, num_outputs, method="exact").exp().to(s.dtype)
        except ValueError as err:
            if spread <= resolution(torch.float64):  # another cause (e.g. a soft mask): its own message
                raise
            raise ValueError(f"{self!r}.expected_value: scores / temperature span {spread:.3g}, more than float64 "
                             f"resolves ({resolution(torch.float64):.3g}), for the exact value of "
                             f"num_outputs={num_outputs} picks: raise the temperature, use OptimalLSR (its greedy "
                             "limit), or mask items with -inf rather than a soft mask such as -1e30") from err
        return (inclusion * q).sum(dim=1) / num_outputs


class UniformLSR:
    """A uniformly random ranking of L candidates (propensities ``1 / (K - l + 1)``).

    Shape:
        ``scores [B, K]`` → ``picks [B, L]`` (positions in ``0..K-1``), ``propensities [B, L]``;
        :meth:`expected_value`: ``scores, q [B, K]`` → ``[B]``.

    Example:
        >>> picks, propensities = UniformLSR()(torch.randn(2, 4), 2)
        >>> picks.shape, propensities
        (torch.Size([2, 2]), tensor([[0.2500, 0.3333],
                [0.2500, 0.3333]]))
    """

    def __call__(self, scores: Tensor, num_outputs: int, generator: torch.Generator | None = None
                 ) -> tuple[Tensor, Tensor]:
        _check(scores, num_outputs)
        keys = torch.rand(scores.shape, generator=generator, device=scores.device)
        picks = keys.topk(num_outputs, dim=1).indices
        left = scores.shape[1] - torch.arange(num_outputs, dtype=scores.dtype, device=scores.device)
        return picks, (1.0 / left).expand(scores.shape[0], -1)

    def expected_value(self, scores: Tensor, q: Tensor, num_outputs: int) -> Tensor:
        _check(scores, num_outputs, q)
        return q.mean(dim=1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


LSR_NAMES = ("optimal", "noisy", "uniform", "anti")


def make_lsr(name: str | LSRPolicy, *, argument: str = "name") -> LSRPolicy:
    """An LSR by name (``"optimal"``, ``"noisy"`` (τ = 1), ``"uniform"``, ``"anti"``) or a callable; errors name
    ``argument`` (the caller's own argument, e.g. ``"train_lsr"``)."""
    if callable(name):
        return name
    table = {"optimal": OptimalLSR, "noisy": NoisyLSR, "uniform": UniformLSR, "anti": AntiOptimalLSR}
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be an LSR name in {LSR_NAMES} or a callable, got {type(name).__name__} "
                        f"{name!r}")
    if name not in table:
        raise ValueError(f"{argument} must be one of {LSR_NAMES} or a callable, got {name!r}")
    return table[name]()
