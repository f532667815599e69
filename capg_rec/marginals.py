"""Inclusion probabilities ``log π(a ∈ A^K | x)`` of the PL(-MoE) ESR: the CA-PG score.

A method is an :class:`InclusionMethod` object; the built-in ones are registered by name, so a
string works wherever a method is taken (``CAPGLoss(K, method="plugin")``):

* :class:`Exact` (``"exact"``): the exponential-race integral with an exact Poisson-binomial count
  (exact up to quadrature for one expert; "block-exact" for a mixture: exact inside each expert
  block, survival across blocks treated as independent).
* :class:`MeanField` (``"mean_field"``, the default): Rosén's successive-sampling approximation
  ``1 - exp(-w_a t)`` with ``Σ_b (1 - exp(-w_b t)) = K``, run block by block for a mixture. O(N).
* :class:`PlugIn` (``"plugin"``): the paper's arg-top-(k-1) plug-in: the hazard at position k is
  evaluated at the most probable prefix of k-1 items *that excludes the target*.
* :class:`Enumeration` (``"enumerate"``): every ordered draw, as long as the draws times the items stay within
  those of 8 items (N ≤ 8, or K ≤ 4 of 13 items, K ≤ 3 of 24, ...).
* :class:`WithReplacement` (``"with_replacement"``): sampling with replacement,
  ``log Σ_k π_{m(k)}(a)`` — the CA-PG-SwR / TOP1-PG score. Not a probability (it can exceed 1:
  it is the expected number of times a is drawn); its gradient is what CA-PG-SwR uses.

Your own approximation: subclass :class:`InclusionMethod` and pass an instance, or register it
with :func:`register_inclusion_method` to use it by name (from the command line, say).

Large catalogs are handled through a head/tail summary (:mod:`capg_rec._head_tail`): every
expert's best items and the targets item by item, the rest through a few streamed power sums.
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd import forward_ad

from capg_rec._enumerate import log_inclusion_probs
from capg_rec._checks import check_count, check_items, check_positive, raise_where_short, resolve_validate_args, \
    under_forward_mode, under_vmap
from capg_rec._exact import DEFAULT_MEMORY_BUDGET, EXACT_NUM_POWERS, exact_log_inclusion
from capg_rec._mean_field import mean_field_log_inclusion
from capg_rec._plugin import plugin_log_inclusion
from capg_rec._head_tail import head_size_for, summarize
from capg_rec._numerics import constant_cache, safe_logsumexp, select_experts
from capg_rec.catalog import CatalogScores, as_catalog, every_score
from capg_rec.plackett_luce import check_enough_items, expert_runs

__all__ = ["InclusionMethod", "Exact", "MeanField", "PlugIn", "WithReplacement", "Enumeration", "inclusion_log_prob",
           "inclusion_method", "register_inclusion_method", "inclusion_methods", "DEFAULT_METHOD"]

Runs = Sequence[tuple[int, int]]

DEFAULT_METHOD = "mean_field"
"""The name of the default method (:class:`MeanField`)."""

LOG_PROB_TOLERANCE = 1e-4
"""How far above its bound (0 for a log-probability, log K for a count) a log-propensity may lie: rounding."""


def _swr(catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
    """``log Σ_m n_m exp(s_m(a) - A_m)``: the CA-PG-SwR score → ``[B, L]``."""
    log_softmax = catalog.log_softmax(items)  # [B, M, L]
    if len(runs) == 1:  # one expert draws all K
        (expert, count), = runs
        one = log_softmax.squeeze(1) if log_softmax.shape[1] == 1 else log_softmax[:, expert]  # a view's backward
        return one + math.log(count)
    log_counts = _log_counts(tuple(runs), catalog.dtype, catalog.device)
    return safe_logsumexp(select_experts(log_softmax, [m for m, _ in runs]) + log_counts, dim=1)


@constant_cache(maxsize=64)
def _log_counts(runs: tuple[tuple[int, int], ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The runs' ``log n_m`` as ``[1, R, 1]`` (made once per runs, dtype and device)."""
    return torch.tensor([math.log(n) for _, n in runs], dtype=dtype, device=device).view(1, -1, 1)


class InclusionMethod(abc.ABC):
    """How ``log π(a ∈ A^K | x)`` is computed from a catalog (subclass it for your own method).

    Attributes:
        is_probability: False for a score that is not a probability (sampling with replacement
            gives ``log E[times drawn]``); the validator then compares it with counts.
        num_powers: the highest catalog power sum ``Σ e^{p·s}`` the method reads (1: the normaliser).
        uses_top_items: whether it reads the catalog's best items (``CatalogScores.top_items``).

    Shape:
        - :meth:`log_inclusion`: a catalog (B rows, M experts, N items) and ``items [B, L]`` → ``[B, L]``
        - :func:`inclusion_log_prob`: ``logits [B, N]`` / ``[B, M, N]`` (or a catalog), ``items [B, L]`` → ``[B, L]``

    Example:
        >>> method = capg_rec.inclusion_method("mean_field")             # an InclusionMethod by its name
        >>> capg_rec.inclusion_log_prob(torch.randn(2, 10), torch.tensor([[0, 1], [2, 3]]), 3, method=method).shape
        torch.Size([2, 2])
    """

    is_probability: bool = True
    num_powers: int = 1
    uses_top_items: bool = True

    @abc.abstractmethod
    def log_inclusion(self, catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
        """``items [B, L]`` (valid ids, may repeat) → ``[B, L]``; ``runs`` = ``((expert, count), ...)``,
        the blocks of :func:`~capg_rec.expert_of_position`, with ``K = Σ count < N``."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))


class WithReplacement(InclusionMethod):
    """``log Σ_k π_{m(k)}(a)``: the expected number of times a is drawn when every position draws
    from the whole catalog (CA-PG-SwR; TOP1-PG for one expert). Costs one softmax.

    Shape:
        ``logits [B, N]`` / ``[B, M, N]`` and ``items [B, L]`` → ``[B, L]``: log expected counts, at most ``log K``.

    Example:
        >>> p = capg_rec.inclusion_log_prob(torch.randn(2, 10), torch.tensor([[0, 1], [2, 3]]), 3,
        ...                                 method=WithReplacement())
        >>> p.shape, bool((p.exp() <= 3).all())
        (torch.Size([2, 2]), True)
    """

    is_probability = False
    uses_top_items = False

    def log_inclusion(self, catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
        return _swr(catalog, items, runs)


class PlugIn(InclusionMethod):
    """The paper's plug-in: each position's hazard at the greedy prefix that excludes the target.

    Shape:
        ``logits [B, N]`` / ``[B, M, N]`` and ``items [B, L]`` → ``[B, L]`` log-probabilities.

    Example:
        >>> p = capg_rec.inclusion_log_prob(torch.randn(2, 10), torch.tensor([[0, 1], [2, 3]]), 3, method=PlugIn())
        >>> p.shape, bool((p <= 0).all())
        (torch.Size([2, 2]), True)
    """

    def log_inclusion(self, catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
        return plugin_log_inclusion(catalog, items, runs)


class MeanField(InclusionMethod):
    """Rosén's successive-sampling (mean-field) approximation, block by block for a mixture.

    Args:
        max_iter: root-solver steps per block at most, all stages counted (under ``torch.compile`` too,
            whose loops also stop once every row is done). Typical scores take one or two, gaps of hundreds up to
            about 25. Stopped short of the root, the value is approximate (a ``RuntimeWarning`` only where a block's
            expected count misses K by more than 1e-3 of it), and its gradient is the root's, not the value's.
        tol: relative accuracy of the rates at which the solve stops, in (0, 1) (default:
            ``eps^(2/3)`` of the dtype).

    Shape:
        ``logits [B, N]`` / ``[B, M, N]`` and ``items [B, L]`` → ``[B, L]`` log-probabilities.

    Example:
        >>> p = capg_rec.inclusion_log_prob(torch.randn(2, 10), torch.tensor([[0, 1], [2, 3]]), 3, method=MeanField())
        >>> p.shape, bool((p <= 0).all())
        (torch.Size([2, 2]), True)
    """

    num_powers = 3

    def __init__(self, max_iter: int = 50, tol: float | None = None) -> None:
        self.max_iter = check_count("max_iter", max_iter)
        self.tol = None if tol is None else check_positive("tol", tol)
        if self.tol is not None and self.tol >= 1:
            raise ValueError(f"tol must be in (0, 1), got {tol}")

    def log_inclusion(self, catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
        return mean_field_log_inclusion(catalog, items, runs, max_iter=self.max_iter, tol=self.tol)


class Exact(InclusionMethod):
    """The exponential-race integral with an exact Poisson-binomial count ("block-exact" for a
    mixture: an approximation, off by up to 0.42 in probability on adversarial catalogs of a few items, where
    ``"enumerate"`` is exact). For validation and tests: its cost is quadrature nodes × head slots × c(K) per row
    (:mod:`capg_rec._exact`), hundreds to thousands of times a softmax.

    Args:
        memory_budget: bytes that one block's autograd state may keep; larger blocks are
            recomputed in backward (default 1 GiB).

    Shape:
        ``logits [B, N]`` / ``[B, M, N]`` and ``items [B, L]`` → ``[B, L]`` log-probabilities.

    Example:
        >>> p = capg_rec.inclusion_log_prob(torch.randn(2, 10), torch.tensor([[0, 1], [2, 3]]), 3, method=Exact())
        >>> p.shape, bool((p <= 0).all())
        (torch.Size([2, 2]), True)
    """

    num_powers = EXACT_NUM_POWERS

    def __init__(self, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.memory_budget = check_count("memory_budget", memory_budget)

    def log_inclusion(self, catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
        if under_vmap():
            raise RuntimeError("the exact method does not run under torch.func.vmap (the sizes of its work depend "
                               "on the scores); use a loop, or another method")
        if len(runs) > 1 and under_forward_mode():  # its mixture's gradients come from a backward of its own
            raise _no_forward_mode()
        head = head_size_for(catalog.num_items, sum(n for _, n in runs))
        if catalog.exact_top < head < catalog.num_items:  # a head read through top_items
            raise ValueError(f"the 'exact' method is not supported here: it reads each expert's best {head} items "
                             f"one by one and the rest's power sums up to p = {self.num_powers}, but this catalog "
                             f"names only its best {catalog.exact_top} exactly (and a sampled catalog estimates "
                             "power sums only to p = 3)")
        if head < catalog.num_items:  # the rest's power sums, taken relative to each row's best where that is cheap
            catalog = catalog._recentred()
        ht = summarize(catalog, items, head, self.num_powers)
        if len(runs) > 1 and any(forward_ad.unpack_dual(t).tangent is not None
                                 for t in (ht.head_scores, ht.tail_log_power_sums)):  # torch.autograd.forward_ad
            raise _no_forward_mode()
        return exact_log_inclusion(ht, runs, memory_budget=self.memory_budget)


class Enumeration(InclusionMethod):
    """Every ordered draw enumerated, in float64: exact for mixtures too (``"exact"`` is block-exact
    there). The reference of the tests and the validator. It holds ``[B, draws, N]`` (``N!/(N-K)!`` draws),
    at most :attr:`max_entries` a row: every draw of 8 items, of K ≤ 4 out of 13, of K ≤ 3 out of 24, ...

    Shape:
        ``logits [B, N]`` / ``[B, M, N]`` and ``items [B, L]`` → ``[B, L]`` log-probabilities (in the catalog's dtype).

    Example:
        >>> logits, items = torch.randn(2, 10), torch.tensor([[0, 1], [2, 3]])
        >>> p = capg_rec.inclusion_log_prob(logits, items, 3, method=Enumeration())
        >>> torch.allclose(p, capg_rec.inclusion_log_prob(logits, items, 3, method=Exact()), atol=1e-4)  # one expert
        True
    """

    max_entries = math.factorial(8) * 8

    @classmethod
    def affordable(cls, num_items: int, num_candidates: int) -> bool:
        """Whether a catalog of ``num_items`` has at most :attr:`max_entries` draws of ``num_candidates`` times
        items (none for K > N: there is no such draw)."""
        num_items, num_candidates = check_count("num_items", num_items), check_count("num_candidates", num_candidates)
        return num_candidates <= num_items and math.perm(num_items, num_candidates) * num_items <= cls.max_entries

    @classmethod
    def check_affordable(cls, num_items: int, num_candidates: int) -> None:
        """``ValueError`` unless :meth:`affordable`, naming the size."""
        if not cls.affordable(num_items, num_candidates):
            if num_candidates > num_items:
                raise ValueError(f"num_candidates must be at most num_items = {num_items} (a draw without "
                                 f"replacement), got {num_candidates}")
            entries = math.perm(num_items, num_candidates) * num_items
            raise ValueError(f"Enumeration holds every ordered draw times every item, N!/(N-K)! × N entries a row, at "
                             f"most {cls.max_entries} (those of 8 items), got "
                             f"{entries if entries < 10**9 else format(entries, '.3g')} for N = {num_items}, "
                             f"K = {num_candidates}")

    def log_inclusion(self, catalog: CatalogScores, items: Tensor, runs: Runs) -> Tensor:
        self.check_affordable(catalog.num_items, sum(n for _, n in runs))
        experts = torch.tensor([m for m, n in runs for _ in range(n)], device=catalog.device)
        log_probs = log_inclusion_probs(every_score(catalog).double(), experts)  # [B, N]
        return log_probs.gather(1, items).to(catalog.dtype)


_KNOWN_LOOKUPS = frozenset(cls.log_inclusion for cls in (WithReplacement, PlugIn, MeanField, Exact, Enumeration))


def _no_forward_mode() -> NotImplementedError:
    return NotImplementedError("the exact method for a mixture of experts has no forward mode (torch.func.jvp, jacfwd, "
                               "hessian, torch.autograd.forward_ad): its tangents would be wrong; use reverse mode "
                               "(torch.func.grad, jacrev)")


def _known_lookups(method: InclusionMethod) -> bool:
    """Whether ``method`` is one of this module's, whose lookups are known (the targets, the catalog's own best
    items, and whole small catalogs through :func:`~capg_rec.catalog.every_score`): a validated loss may then run
    it in its catalog's trust (:func:`capg_rec.functional._prepare`); a method of your own takes every check."""
    # The class's function, not one set on the instance; Dynamo's bound methods have no __func__ that this set holds
    return type(method).log_inclusion in _KNOWN_LOOKUPS and "log_inclusion" not in getattr(method, "__dict__", {})


_REGISTRY: dict[str, Callable[[], InclusionMethod]] = {
    "exact": Exact, "mean_field": MeanField, "plugin": PlugIn, "with_replacement": WithReplacement,
    "enumerate": Enumeration,
}
_BUILT_IN = frozenset(_REGISTRY)


def register_inclusion_method(name: str, factory: Callable[[], InclusionMethod]) -> None:
    """Make ``factory()`` available by ``name`` wherever a method is taken (losses, validator, CLI)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name.isidentifier():  # no spaces: " mean_field" would pass for the built-in
        raise ValueError(f"name must be an identifier (letters, digits, underscores), got {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"name {name!r} is a built-in method's: choose another")
    if not callable(factory):
        raise TypeError(f"factory must be callable (a class or a function), got {type(factory).__name__}")
    try:
        inspect.signature(factory).bind()
    except TypeError as err:
        raise TypeError(f"factory must be callable with no arguments: {err}") from None
    except ValueError:  # a builtin without a signature: called below
        pass
    made = factory()  # made now, so that a factory that makes something else fails here
    if not isinstance(made, InclusionMethod):
        raise TypeError(f"factory() must return an InclusionMethod, got {type(made).__name__}")
    _REGISTRY[name] = factory


def inclusion_methods() -> tuple[str, ...]:
    """The registered method names."""
    return tuple(_REGISTRY)


def inclusion_method(method: str | InclusionMethod) -> InclusionMethod:
    """An :class:`InclusionMethod` from a registered name or an instance (returned as is)."""
    if isinstance(method, InclusionMethod):
        return method
    if not isinstance(method, str):
        raise TypeError(f"method must be an InclusionMethod or a registered name, got {type(method).__name__}")
    if method not in _REGISTRY:
        raise ValueError(f"method must be an InclusionMethod or one of {inclusion_methods()}, got {method!r}")
    made = _REGISTRY[method]()
    if not isinstance(made, InclusionMethod):
        raise TypeError(f"the factory registered as {method!r} returned {type(made).__name__}, not an InclusionMethod")
    return made


def inclusion_log_prob(logits: Tensor | CatalogScores, items: Tensor, num_candidates: int, *,
                       temperature: float = 1.0, method: str | InclusionMethod = DEFAULT_METHOD,
                       validate_args: bool | None = None) -> Tensor:
    """``log π(a ∈ A^K | x)``: log-probability that each item of ``items [B, L]`` is among the K
    candidates drawn from ``logits`` (``[B, N]``, ``[B, M, N]`` or a CatalogScores) → ``[B, L]``.

    ``method`` is an :class:`InclusionMethod` or a registered name (see the module docstring);
    ``WithReplacement`` returns the CA-PG-SwR score, which is not a log-probability. Masked items
    (scored ``-inf``) have log-probability ``-inf``; every row needs at least K unmasked items (a draw with
    replacement, whose expected count ``WithReplacement`` gives, needs none: its K may exceed N too).
    Half-precision logits give float32 results.
    """
    validate = resolve_validate_args(validate_args)
    method = inclusion_method(method)
    catalog = as_catalog(logits, temperature, validate_args=validate)
    check_count("num_candidates", num_candidates, high=catalog.num_items if method.is_probability else None)
    items = check_items("items", items, batch_size=catalog.batch_size, num_items=catalog.num_items,
                        unique=False, validate=validate, device=catalog.device)
    if validate and method.is_probability:
        check_enough_items(catalog, num_candidates)
    return _inclusion_log_prob(catalog, items, num_candidates, method, validate)


def _inclusion_log_prob(catalog: CatalogScores, items: Tensor, num_candidates: int,
                        method: InclusionMethod, validate: bool = False) -> Tensor:
    """:func:`inclusion_log_prob` on validated inputs. A method of your own has its output checked: a tensor of
    the items' shape, floating (and with ``validate``, no NaN and at most its bound: log 1, or log K for an
    expected count)."""
    runs = expert_runs(num_candidates, catalog.num_experts)
    if method.is_probability and num_candidates == catalog.num_items:  # every item is drawn: log 1
        # -inf where no expert that draws a position can take the item (masked under each of them); an item masked
        # under only some of them is drawn by another (it was -inf where the first expert masked it)
        best = catalog.gather(items)[:, sorted({expert for expert, _ in runs})].amax(1)  # [B, L]
        return torch.where(best > -math.inf, best * 0.0, best)  # zero gradient; -inf stays (masked)
    out = method.log_inclusion(catalog, items, runs)
    if not _known_lookups(method):
        _check_output(catalog, method, out, items, num_candidates, validate)
    return out


def _check_output(catalog: CatalogScores, method: InclusionMethod, out: object, items: Tensor, num_candidates: int,
                  validate: bool) -> None:
    """What a method of your own returned for ``items [B, L]``: a floating tensor ``[B, L]`` (TypeError, ValueError
    naming the method); with ``validate``, no NaN and nothing above its bound (one host sync). With ``validate``, on a
    catalog shared by processes, the structure and the values in one agreement of them all: every process raises,
    none waits. Without it, no collective and no sync: a wrong structure raises where it is found."""
    failed: Exception | None = None
    if not isinstance(out, Tensor) or not out.is_floating_point():
        failed = TypeError(f"{method!r}.log_inclusion must return a floating torch.Tensor, got "
                           f"{out.dtype if isinstance(out, Tensor) else type(out).__name__}")
    elif out.shape != items.shape:
        failed = ValueError(f"{method!r}.log_inclusion must return the items' shape {list(items.shape)}, got "
                            f"{list(out.shape)}")
    if not validate:  # no collective, no sync: checks off mean that (torch.compile, hot loops)
        if failed is not None:
            raise failed
        return
    bound = 0.0 if method.is_probability else math.log(num_candidates)
    short = torch.zeros(0, dtype=torch.bool, device=items.device) if failed is not None else \
        ~(out.detach() <= bound + LOG_PROB_TOLERANCE)  # NaN too
    what = "a log-probability (<= 0)" if method.is_probability else f"a log expected count (<= log K = {bound:.4g})"
    message = f"{method!r}.log_inclusion returned values that are not {what}, or NaN"
    # every process that shares the catalog raises (this one its own error, if it has one); alone, agree is as is
    raise_where_short(catalog.agree, short, lambda index: f"{message} (at {list(index)})",
                      f"{message} in another process", failed)
