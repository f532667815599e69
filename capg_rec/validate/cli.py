"""``capg-rec validate package.module:factory``: validate a user's ESR from the command line.

Exit status:
  0  the ESR passes validation
  1  the ESR fails validation: its draws disagree with the probabilities it claims
  2  usage or input error, found before any draw: a bad option, a factory that cannot be found or
     does not make an ESR, B = 0 contexts, a --json or --plot path that cannot be written
  3  the ESR crashed: importing its module, its factory or one of its methods or attributes raised an
     exception (traceback on stderr), or returned output that breaks the ESR protocol
  4  the validator itself failed: a bug of capg_rec's, or an output of the ESR it could not read
     (traceback on stderr)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from capg_rec._json import json_text
from capg_rec.validate.protocol import ESR
from capg_rec.validate.validation import validate_esr

__all__ = ["load_factory", "register", "EXIT_PASS", "EXIT_FAIL", "EXIT_USAGE", "EXIT_CRASH", "EXIT_INTERNAL"]

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CRASH, EXIT_INTERNAL = 0, 1, 2, 3, 4
_EXIT_STATUS = __doc__[__doc__.index("Exit status:"):] if __doc__ else ""


class _UsageError(ValueError):
    """Bad input, found before any draw: exit status 2."""


class _ESRCrash(Exception):
    """The user's code raised, or returned what the ESR protocol forbids: exit status 3."""


def _find_factory(spec: str) -> Callable[[], Any]:
    """The function ``package.module:function`` names (the current directory is importable, as
    with ``python -m``). ``ValueError`` if there is none; what importing the module raises propagates."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise _UsageError(f"factory must look like package.module:function, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:  # the named module, not one that it imports
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise
        raise _UsageError(f"factory {spec}: no module named {err.name!r}") from err
    for part in attr.split("."):
        if not hasattr(target, part):
            raise _UsageError(f"factory {spec}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise _UsageError(f"factory {spec} must be callable, got {type(target).__name__}")
    return target


def _as_esr(spec: str, made: object) -> tuple[ESR, Any]:
    esr, contexts = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    # Looked up without running them (isinstance(esr, ESR) runs its properties): a property that raises is the
    # ESR's crash, found by the guarded read that follows, not a missing member or the validator's own error.
    missing = [name for name in ("num_candidates", "sample", "inclusion_log_prob") if not _has(esr, name)]
    if missing:
        raise _UsageError(f"factory {spec} must return an ESR or (ESR, contexts): an object with num_candidates, "
                          "sample(contexts, num_samples, generator) and inclusion_log_prob(contexts); got "
                          f"{type(esr).__name__}, which has no {', '.join(missing)}")
    return esr, contexts


def _has(obj: object, name: str) -> bool:
    """Whether ``obj`` has ``name``, without running a property: looked up statically, or (for an object that makes
    attributes in ``__getattr__``) read, where anything it raises but AttributeError says the attribute is there."""
    try:
        inspect.getattr_static(obj, name)
        return True
    except AttributeError:
        pass
    if inspect.getattr_static(type(obj), "__getattr__", None) is None:
        return False
    try:
        return hasattr(obj, name)
    except Exception:  # noqa: BLE001 - it is there, and crashes: the guarded read reports it
        return True


def load_factory(spec: str) -> tuple[ESR, Any]:
    """Import ``package.module:factory`` and call it; it returns an ESR or ``(ESR, contexts)``.

    The current directory is importable, as with ``python -m``. ``ValueError`` when ``spec`` does
    not name a function that makes an ESR; what the module or the factory raises propagates.
    """
    return _as_esr(spec, _find_factory(spec)())


class _Guarded:
    """The user's ESR, every call into it marked: what it raises is the ESR's crash, not the
    validator's, and claims for B = 0 contexts are refused before any draw."""

    def __init__(self, esr: ESR) -> None:
        self._esr = esr

    @property
    def num_candidates(self) -> int:
        return self._read("num_candidates")

    def sample(self, contexts: Any, num_samples: int, generator: torch.Generator) -> Tensor:
        return self._call("sample", contexts, num_samples, generator)

    def inclusion_log_prob(self, contexts: Any) -> Tensor:
        claims = self._call("inclusion_log_prob", contexts)
        if isinstance(claims, Tensor) and claims.ndim == 2 and claims.shape[0] == 0:
            raise _UsageError("the ESR has B = 0 contexts (its inclusion_log_prob is [0, N]): nothing to validate")
        return claims

    def __getattr__(self, name: str) -> Any:  # the optional members: with_replacement, candidate_log_prob
        value = self._read(name)
        return functools.partial(self._call, name) if callable(value) else value

    def _read(self, name: str) -> Any:
        """An attribute of the ESR (a property may run its code); an absent one is an AttributeError as usual."""
        try:
            return getattr(self._esr, name)
        except AttributeError:
            if name in dir(type(self._esr)):  # a property of its own that raised AttributeError: its crash
                raise _ESRCrash(f"esr.{name} raised AttributeError") from None
            raise
        except Exception as err:
            raise _ESRCrash(f"esr.{name} raised {type(err).__name__}: {err}") from err

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._esr, name)(*args)
        except Exception as err:
            raise _ESRCrash(f"esr.{name} raised {type(err).__name__}: {err}") from err


def _num_contexts(contexts: Any) -> int | None:
    """B for contexts that say it themselves (a tensor, an array, a list or a tuple), else None."""
    shape = getattr(contexts, "shape", None)
    if isinstance(shape, tuple) and len(shape) >= 1:
        return int(shape[0])
    return len(contexts) if isinstance(contexts, list | tuple) else None


def _check_writable(flag: str, path: str | None) -> None:
    if path is None:
        return
    target = Path(path)
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as err:
        raise _UsageError(f"{flag} {path} cannot be written: {err.strerror or err}") from err
    if not existed:
        target.unlink()


def _number(kind: type, low: float, high: float = math.inf, *, open_low: bool = False) -> Callable[[str], Any]:
    """An argparse type: ``kind`` in [low, high) (or (low, high) with ``open_low``)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an int' if kind is int else 'a number'}, got {text!r}") \
                from None
        if not (low < value if open_low else low <= value) or not value < high:
            bound = f"{'(' if open_low else '['}{low:g}, {high:g})"
            raise argparse.ArgumentTypeError(f"must be in {bound}, got {text}")
        return value
    return parse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("validate", help="check an ESR's claimed probabilities against its own samples",
                              description="Import package.module:factory (returning an ESR, or (ESR, contexts)), "
                                          "run capg_rec.validate.validate_esr and print the report.",
                              epilog=_EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("factory", help="package.module:function")
    p.add_argument("--samples", type=_number(int, 1), default=20_000, help="draws per context (default 20000)")
    p.add_argument("--alpha", type=_number(float, 0, 1, open_low=True), default=1e-3,
                   help="false-alarm probability (default 1e-3)")
    p.add_argument("--seed", type=_number(int, 0, 2**63), default=0)
    p.add_argument("--tolerance", type=_number(float, 0), default=0.0,
                   help="accepted absolute error of the claims (for approximations)")
    p.add_argument("--plot", metavar="PNG", help="write claimed vs empirical probabilities here")
    p.add_argument("--json", metavar="PATH", help="write the report here as JSON")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.set_defaults(func=_main)


def _exit(code: int, message: str) -> NoReturn:
    print(f"capg-rec validate: {message}", file=sys.stderr)
    raise SystemExit(code)


def _main(args: argparse.Namespace) -> None:
    """Run the command; exit with the status the module docstring lists (nothing for a pass)."""
    try:
        passed = _validate(args)
    except _UsageError as err:
        _exit(EXIT_USAGE, f"error: {err}")
    except _ESRCrash as err:
        if err.__cause__ is not None:
            traceback.print_exception(err.__cause__)
        _exit(EXIT_CRASH, f"error in the ESR: {err}")
    except Exception as err:  # not the ESR's, nor a verdict on it: its status must not read as a failed validation
        traceback.print_exception(err)
        _exit(EXIT_INTERNAL, f"internal error of the validator (or an output of the ESR it could not read): "
                             f"{type(err).__name__}: {err}")
    if not passed:
        raise SystemExit(EXIT_FAIL)


def _validate(args: argparse.Namespace) -> bool:
    _check_writable("--json", args.json)
    _check_writable("--plot", args.plot)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise _UsageError("--plot needs matplotlib: pip install matplotlib")
    if args.plot is not None:  # matplotlib picks the format from the suffix: an unknown one would fail after the run
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        if Path(args.plot).suffix.lstrip(".").lower() not in formats:
            raise _UsageError(f"--plot {args.plot}: the suffix must name an image format, one of "
                              f"{', '.join(sorted(formats))}")
    module_name = args.factory.partition(":")[0]
    try:
        factory = _find_factory(args.factory)
    except _UsageError:
        raise
    except Exception as err:
        raise _ESRCrash(f"importing {module_name} raised {type(err).__name__}: {err}") from err
    try:
        made = factory()
    except Exception as err:
        raise _ESRCrash(f"the factory {args.factory} raised {type(err).__name__}: {err}") from err
    esr, contexts = _as_esr(args.factory, made)
    if _num_contexts(contexts) == 0:
        raise _UsageError(f"the factory {args.factory} returned B = 0 contexts: nothing to validate")
    try:
        report = validate_esr(_Guarded(esr), contexts, num_samples=args.samples, alpha=args.alpha, seed=args.seed,
                              tolerance=args.tolerance, progress=args.progress)
    except (_UsageError, _ESRCrash):
        raise
    except (ValueError, TypeError) as err:  # the options are checked: what is left is the ESR's (its attributes too)
        raise _ESRCrash(f"its output breaks the ESR protocol: {err}") from None
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json_text(report.to_dict(), indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {report.plot(args.plot)}")
    return report.passed
