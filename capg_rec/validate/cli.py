"""``capg-rec validate package.module:factory``: validate a user's ESR from the command line."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from capg_rec.validate.protocol import ESR
from capg_rec.validate.validation import validate_esr


def load_factory(spec: str) -> tuple[ESR, Any]:
    """Import ``package.module:factory`` and call it; it returns an ESR or ``(ESR, contexts)``.

    The current directory is importable, as with ``python -m``.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory must look like package.module:function, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    made = target()
    esr, contexts = made if isinstance(made, tuple) else (made, None)
    if not isinstance(esr, ESR):
        raise ValueError(f"factory {spec} must return an ESR or (ESR, contexts), got {type(esr).__name__}")
    return esr, contexts


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="check an ESR's claimed probabilities against its own samples",
                              description="Import package.module:factory (returning an ESR, or (ESR, contexts)), "
                                          "run capg_rec.validate.validate_esr and print the report. "
                                          "Exit status 1 when the validation fails.")
    p.add_argument("factory", help="package.module:function")
    p.add_argument("--samples", type=int, default=20_000, help="draws per context (default 20000)")
    p.add_argument("--alpha", type=float, default=1e-3, help="false-alarm probability (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="accepted absolute error of the claims (for approximations)")
    p.add_argument("--plot", metavar="PNG", help="write claimed vs empirical probabilities here")
    p.add_argument("--json", metavar="PATH", help="write the report here as JSON")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> None:
    esr, contexts = load_factory(args.factory)
    report = validate_esr(esr, contexts, num_samples=args.samples, alpha=args.alpha, seed=args.seed,
                          tolerance=args.tolerance, progress=args.progress)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {report.plot(args.plot)}")
    if not report.passed:
        raise SystemExit(1)
