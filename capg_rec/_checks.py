"""Input validation shared by the public functions (private).

A wrong type raises ``TypeError``, a wrong value ``ValueError``; every message names the argument,
what was expected and what was given. Structural checks (types, shapes) cost nothing and always
run; value checks (finiteness, id ranges) are a pass over the data and a host sync each, and run
only when validation is on (:func:`set_default_validate_args`, or an entry point's
``validate_args``), as in ``torch.distributions``.
"""

from __future__ import annotations

import argparse
import collections
import math
import numbers
import re
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["set_default_validate_args"]

_validate_default = True


def set_default_validate_args(value: bool) -> None:
    """Turn the value checks of every capg_rec entry point on (the default) or off.

    An entry point's own ``validate_args`` argument, when given, wins. With checks off, invalid
    inputs give undefined results; the checks' host syncs are gone (what ``torch.compile`` needs).
    """
    global _validate_default
    _validate_default = check_flag("value", value)


def validating_by_default() -> bool:
    """Whether the checks are on by default (:func:`set_default_validate_args`), for code that has no argument of
    its own to turn them off and runs its checks only where they read host memory (no error under compile)."""
    return _validate_default


def resolve_validate_args(value: bool | None) -> bool:
    """An entry point's ``validate_args``: the module default when ``None``. The value checks read tensors'
    values, which ``torch.func.vmap`` and a graph of ``torch.compile`` cannot: there they must be off (a clear error
    instead of theirs; outside ``fullgraph``, torch.compile runs the checks eagerly, between graphs)."""
    validate = _validate_default if value is None else check_flag("validate_args", value)
    if validate and torch.compiler.is_compiling():
        raise RuntimeError("capg_rec's value checks read tensor values, which torch.compile cannot trace into its "
                           "graph: pass validate_args=False (a catalog keeps its own setting: build it with "
                           "validate_args=False too), or call capg_rec.set_default_validate_args(False)")
    if validate and under_vmap():
        raise RuntimeError("capg_rec's value checks read tensor values, which torch.func.vmap does not allow: pass "
                           "validate_args=False inside vmap (or call capg_rec.set_default_validate_args(False))")
    return validate


def under_vmap() -> bool:
    """Whether a ``torch.func.vmap`` transform is active (at any level)."""
    return _under(torch._C._functorch.TransformType.Vmap)


def under_forward_mode() -> bool:
    """Whether a forward-mode ``torch.func`` transform (``jvp``, ``jacfwd``, ``hessian``) is active."""
    return _under(torch._C._functorch.TransformType.Jvp)


def _under(transform: object) -> bool:
    if not torch._C._are_functorch_transforms_active():  # what Dynamo traces (it cannot trace the stack's query)
        return False
    stack = torch._C._functorch.get_interpreter_stack()
    return bool(stack) and any(level.key() == transform for level in stack)


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer, Python's or numpy's (``np.int64``), and not a bool."""
    # Python's int first: an ABC's isinstance costs ~4x, and counts are checked on every loss call
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def is_number(value: object) -> bool:
    """Whether ``value`` is a real number, Python's or numpy's (``np.float32``, ``np.int64``), and not a bool
    (numpy's bool is no ``numbers.Real``)."""
    return type(value) in (float, int) or (isinstance(value, numbers.Real) and not isinstance(value, bool))


def python_number(value: object) -> object:
    """``value`` as Python's int or float if it is a number (numpy's too: JSON and names take Python's), else as is."""
    if type(value) in (int, float) or not is_number(value):
        return value
    return int(value) if is_int(value) else float(value)


def check_positive(name: str, value: float) -> float:
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_flag(name: str, value: bool) -> bool:
    """``value`` as Python's bool (numpy's too: ``np.True_``); a ``TypeError`` naming ``name`` for anything else."""
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__module__}.{type(value).__qualname__} "
                    f"{value!r}")


def check_device(name: str, value: object) -> torch.device:
    """``value`` (a ``torch.device`` or a device string) as a ``torch.device``: a ``TypeError`` naming ``name`` for
    another type (a bare index too: ``3`` is ``"cuda:3"`` to torch, which a CPU user rarely means), a ``ValueError``
    for a string that names no device torch knows."""
    if not isinstance(value, (torch.device, str)):
        raise TypeError(f"{name} must be a torch.device, a str or None, got {type(value).__name__} {value!r}")
    try:
        return torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{name} must name a torch device, got {value!r} ({error})") from None


def check_same_device(device: torch.device | str, **tensors: Tensor | None) -> None:
    """A ``ValueError`` naming the first of ``tensors`` (None: absent) that is not on the scores' ``device`` (a
    catalog of your own may name it as a string, or without an index: ``"cuda"`` is the current one's)."""
    device = device if type(device) is torch.device else torch.device(device)
    cpu = device.type == "cpu"
    if not cpu and device.index is None and device.type != "meta":
        device = torch.empty(0, device=device).device  # the current device of its type, with its index
    for name, x in tensors.items():
        if x is not None and not (x.is_cpu if cpu else x.device == device):
            raise ValueError(f"{name} must be on the scores' device {device}, got {x.device}")


def check_generator(generator: object) -> torch.Generator | None:
    """``generator`` itself: a ``torch.Generator`` or None (a ``TypeError`` naming it otherwise)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return generator


def check_count(name: str, value: int, *, low: int = 1, high: int | None = None) -> int:
    """``value`` as a Python int (numpy's integers too: ``np.int64(10)``) in ``[low, high]``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (argparse then exits 2 naming the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def flagged(message: str, args: argparse.Namespace, **renamed: str) -> str:
    """An error raised by code that a command called with its parsed ``args``, in the command line's words: each
    option's name (``num_outputs``) as its flag (``--num-outputs``) where it leads the message, or, for a name with an
    underscore, stands before ``=`` as a word of its own (``<= num_candidates=5``, ``got capg_method='exact'``): not in
    a path or a value the user typed (``got the folder runs/batch_size``, ``got 'eval_every'``); ``renamed``: the
    callee's own name for an option's value (``path="--data"``), or an option's name kept as it is where it is not
    the option (``env="env"``)."""
    flags = {name: "--" + name.replace("_", "-") for name in vars(args) if name != "func"}
    for name, flag in {**flags, **renamed}.items():
        if re.match(rf"{name}(?=[ :])", message):
            message = flag + message[len(name):]
        if "_" in name:
            message = re.sub(rf"(?<![\w.\-/'\"]){name}(?==)", flag, message)
    return message


def positive_int_pair(names: str) -> Callable[[str], tuple[int, int]]:
    """An argparse ``type`` for two integers >= 1 written ``a,b``, named ``names`` (e.g. ``"K,M"``) in its errors."""
    def parse(text: str) -> tuple[int, int]:
        try:
            first, second = (int(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {names} (two integers), got {text!r}") from None
        if first < 1 or second < 1:
            raise argparse.ArgumentTypeError(f"{' and '.join(names.split(','))} must be >= 1, got {text!r}")
        return first, second
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (argparse then exits 2 naming the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1] (argparse then exits 2 naming the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value}")
    return value


def check_distinct(name: str, values: Sequence[object]) -> None:
    """``ValueError`` naming ``name`` where a value repeats (a grid that would run or count a cell twice)."""
    repeated = sorted((v for v, n in collections.Counter(values).items() if n > 1), key=str)
    if repeated:
        raise ValueError(f"{name} must not repeat a value, got {list(values)} ({repeated} more than once)")


def check_float_tensor(name: str, x: object, *, ndims: tuple[int, ...], validate: bool = True,
                       allow_masked: bool = False) -> Tensor:
    """A floating tensor of one of ``ndims`` dims; with ``validate``, no NaN and no ``+inf`` (and
    no ``-inf`` either unless ``allow_masked``: ``-inf`` marks an item outside a row's catalog)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dims, got shape {tuple(x.shape)}")
    if not validate or not x.numel():
        return x
    check_readable(name, x)
    if allow_masked:
        if not float(_memory_order(x.detach()).amax()) < math.inf:  # amax propagates NaN
            raise ValueError(f"{name} must be finite or -inf (masked): no NaN or +inf")
    elif not all_finite(x):
        lo, hi = value_range(x)
        raise ValueError(f"{name} must be finite: no NaN or inf, got values in [{lo}, {hi}]")
    return x


def check_readable(name: str, x: Tensor) -> None:
    """A ``ValueError`` naming ``x`` if it lies on the meta device, whose tensors hold no values to check."""
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, whose tensors hold no values to check")


def value_range(x: Tensor) -> tuple[float, float]:
    """``(min, max)`` of ``x`` (NaN if any is NaN), in one reduction over memory order (no copy)."""
    if x.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(_memory_order(x.detach()))
    return float(lo), float(hi)


def _memory_order(x: Tensor) -> Tensor:
    """``x`` permuted so that its dims run in memory order (a reduction then reads it without a copy)."""
    return x.permute(sorted(range(x.dim()), key=x.stride, reverse=True))


def all_finite(x: Tensor) -> bool:
    """No NaN or inf in ``x``: one min/max reduction (NaN propagates), ~10x cheaper than isfinite().all()."""
    lo, hi = value_range(x)
    return math.isfinite(lo) and math.isfinite(hi)


def is_id_tensor(x: object) -> bool:
    """Whether ``x`` is a tensor of an integer dtype (not bool, floating or complex): what ids may be."""
    return isinstance(x, Tensor) and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def check_id_tensor(name: str, items: object, *, batch_size: int, width: int | None = None,
                    allow_empty: bool = False, columns: str = "L") -> Tensor:
    """Structural checks of an id tensor ``[B, L]`` (integer dtype, shape; ``columns`` names its width in
    messages, e.g. ``"K"`` for a draw); returns it as int64."""
    if not isinstance(items, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of item ids, got {type(items).__name__}")
    if not is_id_tensor(items):
        raise TypeError(f"{name} must have an integer dtype, got {items.dtype}")
    if items.dim() != 2 or items.shape[0] != batch_size:
        raise ValueError(f"{name} must have shape [B={batch_size}, {columns}], got {tuple(items.shape)}")
    if width is not None and items.shape[1] != width:
        raise ValueError(f"{name} must have {width} columns, got {items.shape[1]}")
    if items.shape[1] == 0 and not allow_empty:
        raise ValueError(f"{name} must have at least one column")
    return items if items.dtype == torch.int64 else items.long()


def check_items(name: str, items: object, *, batch_size: int, num_items: int, unique: bool = True,
                width: int | None = None, validate: bool = True, low: int = 0, columns: str = "L",
                device: torch.device | str | None = None) -> Tensor:
    """An id tensor ``[B, L]`` (on ``device``, if given: the scores'); with ``validate``, ids in ``[low, num_items)``
    (``low = -1`` admits padding) and, with ``unique``, no id twice in a row. Returns it as int64."""
    items = check_id_tensor(name, items, batch_size=batch_size, width=width, allow_empty=low < 0, columns=columns)
    if device is not None:
        check_same_device(device, **{name: items})
    if not validate or items.numel() == 0:
        return items
    check_readable(name, items)
    host = _host_view(items)
    lo, hi = (int(host.min()), int(host.max())) if host is not None else (int(v) for v in torch.aminmax(items))
    if lo < low or hi >= num_items:
        raise ValueError(f"{name} must hold ids in [{low}, {num_items}), got values in [{lo}, {hi}]")
    if unique and items.shape[1] > 1:
        s = np.sort(host, axis=1) if host is not None else items.sort(dim=1).values  # numpy's: 20x at width 200
        if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
            raise ValueError(_repeat_message(name))
    return items


FAILED_ELSEWHERE = "an input check failed in another process (which raised its error)"
"""What a process whose inputs passed raises when another's failed (every process raises)."""


def raise_where_short(agree: Callable[[Tensor], Tensor], short: Tensor, message: Callable[[tuple[int, ...]], str],
                      elsewhere: str, failed: Exception | None = None) -> None:
    """``ValueError`` in every process that shares ``agree`` (a catalog's) if ``short`` (bool, any shape) holds a
    True in any of them: ``message(index)`` of this process's first one, or ``elsewhere`` where it has none.
    ``failed``: this process's own arguments were bad (it takes part all the same, with placeholders): every process
    raises, this one ``failed``. One agreement, taken whatever ``short``'s shape (an empty batch included)."""
    passed, fine = agree(torch.stack([~short.any(), torch.tensor(failed is None, device=short.device)])).tolist()
    if not fine:
        raise failed if failed is not None else ValueError(FAILED_ELSEWHERE)
    if passed:
        return
    if not bool(short.any()):
        raise ValueError(elsewhere)
    raise ValueError(message(tuple(int(v) for v in short.nonzero()[0])))


_SMALL = 4096  # elements below which an op's fixed cost outweighs its pass over the data
_WIDE, _COUNTS = 64, 1 << 22  # rows wider than this are checked by counting, if B·N stays below that
_HOST_TYPES = (Tensor, torch.nn.Parameter)


def _host_view(x: Tensor) -> np.ndarray | None:
    """``x`` as a numpy view if it is a plain tensor in host memory of a dtype numpy reads, outside
    ``torch.compile`` and ``torch.func`` transforms; else None (the check then runs as torch ops)."""
    if (not x.is_cpu or type(x) not in _HOST_TYPES or x.dtype == torch.bfloat16 or x.is_neg()
            or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()):
        return None
    return x.detach().numpy()


def _host_in_range(host: np.ndarray, num_items: int) -> bool:
    """Every id of an int64 array in ``[0, num_items)``: one reduction (negative ids read as unsigned are
    above any catalog size)."""
    return bool(host.view(f"u{host.itemsize}").max() < num_items)


def _repeat_message(name: str) -> str:
    return f"{name} must not repeat an item within a row"


class DeferredChecks:
    """Value checks read back together: :meth:`run` raises ``ValueError`` with the first failing
    check's message.

    Tensors in host memory are checked where they lie, through numpy (an op on a small array costs
    ~1 µs there against ~4 µs for a torch op, and a CPU ``torch.sort`` of rows of 200 ids is ~20x
    numpy's); others are reduced to 0-dim bool tensors and read back in ONE host sync."""

    def __init__(self) -> None:
        self._checks: list[tuple[Tensor | bool, str]] = []
        self._hosts: dict[int, tuple[Tensor, np.ndarray | None]] = {}

    def _host(self, x: Tensor) -> np.ndarray | None:
        """:func:`_host_view` of ``x``, made once per tensor (a tensor is often read by several checks)."""
        seen = self._hosts.get(id(x))
        if seen is None or seen[0] is not x:
            seen = self._hosts[id(x)] = (x, _host_view(x))
        return seen[1]

    def require(self, ok: Tensor | bool, message: str) -> None:
        self._checks.append((ok, message))  # a 0-dim tensor or a bool

    def no_nan_or_inf(self, name: str, x: Tensor, *, allow_masked: bool = False) -> bool:
        """No NaN, no ``+inf``, and no ``-inf`` unless ``allow_masked`` (then one ``amax``, which
        propagates NaN: a third of ``aminmax``'s cost; small tensors take the fewest ops). Returns
        whether ``x`` may hold ``-inf`` (False only when read on the host and it holds none), so that
        checks that only masked entries can fail may be skipped."""
        if x.numel() == 0:
            return False
        message = (f"{name} must be {'finite or -inf (masked)' if allow_masked else 'finite'} "
                   f"(no NaN or {'+inf' if allow_masked else 'inf'})")
        host = self._host(x)
        if host is not None:
            if not allow_masked and x.numel() <= _SMALL:  # small: one numpy call
                self.require(bool(np.isfinite(host).all()), message)
                return False
            if math.isfinite(x.detach().sum().numpy()):  # a finite sum has finite terms: one vectorised pass
                self.require(True, message)
                return False
            if not allow_masked:  # else a NaN, an inf, or a sum that overflowed
                self.require(bool(np.isfinite(host).all()), message)
                return False
            self.require(bool(host.max() < math.inf), message)  # max: NaN propagates
            return bool(host.min() == -math.inf)
        x = _memory_order(x.detach())
        if allow_masked:
            ok = x.amax() < math.inf
        elif x.numel() <= _SMALL:
            ok = (x * 0 == 0).all()  # NaN and ±inf times 0 are NaN; fewer ops than isfinite()
        else:
            lo, hi = torch.aminmax(x)
            ok = (hi < math.inf) & (lo > -math.inf)
        self.require(ok, message)
        return allow_masked

    def all_above(self, x: Tensor, bound: float, message: str) -> None:
        """Requires every entry of ``x`` above ``bound``."""
        host = self._host(x)
        self.require(bool((host > bound).all()) if host is not None else (x.detach() > bound).all(), message)

    def at_most(self, x: Tensor, bound: float, message: str) -> None:
        """Requires every entry of ``x`` at most ``bound`` (NaN fails)."""
        host = self._host(x)
        self.require(bool((host <= bound).all()) if host is not None else (x.detach() <= bound).all(), message)

    def ids_in_range(self, name: str, items: Tensor, num_items: int, *, distinct: bool = False) -> Tensor:
        """Requires ids in ``[0, num_items)`` and, with ``distinct``, no id twice in a row of ``items [B, L]``;
        returns ``items`` clamped into that range (safe to gather)."""
        if not items.numel():
            return items
        message = f"{name} must hold ids in [0, {num_items})"
        host = self._host(items)
        if host is None:
            inside = items.clamp(0, max(num_items - 1, 0))
            self.require((inside == items).all(), message)
            if distinct:
                self.distinct(name, inside, num_items)  # clamped ids: out-of-range ones fail above
            return inside
        ok = _host_in_range(host, num_items)
        self.require(ok, message)
        if distinct:
            self.distinct(name, items)
        return items if ok else items.clamp(0, max(num_items - 1, 0))

    def draw_and_picks(self, candidates: Tensor, chosen: Tensor, num_items: int, *, distinct: bool,
                       picks: str = "chosen") -> Tensor:
        """Requires ``candidates [B, K]`` ids in ``[0, num_items)`` (with ``distinct``, none twice in a row),
        ``chosen [B, L]`` ids none twice in a row and each in its row of candidates; returns the candidates
        clamped into range (safe to gather). In host memory: one pass over ``[B, L, K]`` for the last two."""
        low, high = self._host(chosen), self._host(candidates)
        subset = f"{picks} must be a subset of candidates in every row (the LSR picks among them)"
        if (distinct and low is not None and high is not None and chosen.numel()
                and high.shape[0] * num_items <= _COUNTS and _host_in_range(high, num_items)
                and _host_in_range(low, num_items)):
            self._marked_draw_and_picks(high, low, num_items, subset=subset, name=picks)
            return candidates
        if low is None or high is None or not chosen.numel():
            inside = self.ids_in_range("candidates", candidates, num_items, distinct=distinct)
            self.distinct(picks, chosen)
            self.subset(chosen, candidates, subset)
            return inside
        inside = self.ids_in_range("candidates", candidates, num_items, distinct=distinct)
        same = low[:, :, None] == high[:, None, :]  # [B, L, K]
        # Each pick a candidate, and no candidate picked twice (then no pick repeats).
        self.require(chosen.shape[1] < 2 or bool(same.sum(1).max() <= 1), _repeat_message(picks))
        self.require(bool(same.any(2).all()), subset)
        return inside

    def _marked_draw_and_picks(self, high: np.ndarray, low: np.ndarray, num_items: int, *, subset: str,
                               name: str) -> None:
        """:meth:`draw_and_picks` of distinct in-range ids in host memory by marking each row's candidates in a
        ``[B, N]`` bitmap (a few passes over ``B·N`` bytes rather than a sort of every row and a ``[B, L, K]``
        comparison): candidates are distinct if ``B·K`` cells are marked, picks are candidates if their cells
        are, and are distinct if clearing them unmarks ``B·L`` cells."""
        offsets = np.arange(0, high.shape[0] * num_items, num_items)[:, None]
        marks = np.zeros(high.shape[0] * num_items, dtype=np.bool_)
        marks[(high + offsets).ravel()] = True
        marked = np.count_nonzero(marks)
        self.require(bool(marked == high.size), _repeat_message("candidates"))
        picks = (low + offsets).ravel()
        inside = bool(marks[picks].all())
        if low.shape[1] > 1:
            if inside:
                marks[picks] = False
                once = np.count_nonzero(marks) == marked - low.size
            else:  # a pick outside its row's candidates: clearing would miscount
                ordered = np.sort(low, axis=1)
                once = bool((ordered[:, 1:] != ordered[:, :-1]).all())
            self.require(bool(once), _repeat_message(name))
        self.require(inside, subset)

    def distinct(self, name: str, items: Tensor, num_items: int | None = None) -> None:
        """Requires no id twice in a row of ``items [B, L]``: by a sort, or, for wide rows of ids known to
        lie in ``[0, num_items)``, by counting them (a CPU ``torch.sort`` of rows wider than ~128 is 15x
        slower; numpy's is not)."""
        if items.numel() == 0 or items.shape[1] < 2:
            return
        message = _repeat_message(name)
        host = self._host(items)
        if host is not None:
            s = np.sort(host, axis=1)
            self.require(bool((s[:, 1:] != s[:, :-1]).all()), message)
        elif num_items is not None and items.shape[1] > _WIDE and items.shape[0] * num_items <= _COUNTS:
            counts = torch.zeros(items.shape[0], num_items, dtype=torch.int32, device=items.device)
            self.require(counts.scatter_add_(1, items, torch.ones_like(items, dtype=torch.int32)).amax() <= 1,
                         message)
        else:
            s = items.sort(dim=1).values
            self.require((s[:, 1:] != s[:, :-1]).all(), message)

    def subset(self, sub: Tensor, sup: Tensor, message: str) -> None:
        """Requires every id of a row of ``sub [B, L]`` in the same row of ``sup [B, K]``."""
        if not sub.numel():
            return
        low, high = self._host(sub), self._host(sup)
        if low is not None and high is not None:
            self.require(bool((low[:, :, None] == high[:, None, :]).any(2).all()), message)
        else:
            self.require((sub.unsqueeze(2) == sup.unsqueeze(1)).any(2).all(), message)

    def run(self, agree: Callable[[Tensor], Tensor] | None = None) -> None:
        """Raise the first failing check; ``agree`` combines the results with other processes (e.g.
        :meth:`capg_rec.CatalogScores.agree`; ``None``: one process), so that every process raises an error or
        none does.

        The checks a process takes can differ in number between processes (paths that depend on the data, an
        empty batch), so the first agreement has a fixed size: whether all passed, and the number of checks.
        Only when one failed somewhere, and every process took as many, a second agreement of them all lets
        every process raise that check's message; otherwise a process whose checks all passed says that
        another one failed."""
        if agree is None:
            if all(isinstance(ok, bool) for ok, _ in self._checks):  # read on the host: no sync
                results = [ok for ok, _ in self._checks]
            else:
                results = self._local().tolist()  # one sync
            for ok, (_, message) in zip(results, self._checks):
                if not ok:
                    raise ValueError(message)
            return
        local = self._local()
        count = torch.tensor([(len(self._checks) >> i) & 1 for i in range(_COUNT_BITS)], dtype=torch.bool,
                             device=local.device)
        first = agree(torch.cat([local.all().reshape(1), count, ~count])).tolist()  # one sync
        if first[0]:
            return
        ones, zeros = first[1: 1 + _COUNT_BITS], first[1 + _COUNT_BITS:]
        here = local.tolist()
        if all(one or zero for one, zero in zip(ones, zeros)):  # every bit the same everywhere: as many checks
            for mine, everywhere, (_, message) in zip(here, agree(local).tolist(), self._checks):
                if not everywhere:
                    raise ValueError(message + (" (in another process)" if mine else ""))
        for mine, (_, message) in zip(here, self._checks):
            if not mine:
                raise ValueError(message)
        raise ValueError(FAILED_ELSEWHERE)

    def _local(self) -> Tensor:
        """The checks' results as one bool tensor ``[C]`` (on the device of the first tensor among them)."""
        device = next((ok.device for ok, _ in self._checks if isinstance(ok, Tensor)), torch.device("cpu"))
        if not self._checks:
            return torch.ones(0, dtype=torch.bool, device=device)
        return torch.stack([torch.as_tensor(ok, device=device) for ok, _ in self._checks]).bool()


_COUNT_BITS = 16  # DeferredChecks.run's agreement on the number of checks: fewer than 2^16
