"""Time one validation of a 1000-item, K = 50 ESR at the default settings.

    OMP_NUM_THREADS=1 python benchmarks/validate_runtime.py [--contexts 4] [--method exact]

Prints the time of the claims (inclusion probabilities of every item), of the whole validation,
and the report.
"""

from __future__ import annotations

import argparse
import time

import torch

from capg_rec.validate import CatalogESR, validate_esr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--candidates", type=int, default=50)
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--experts", type=int, default=1)
    parser.add_argument("--method", default="exact")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    shape = (args.contexts, args.items) if args.experts == 1 else (args.contexts, args.experts, args.items)
    esr = CatalogESR(torch.randn(*shape, generator=g), args.candidates, method=args.method)
    start = time.perf_counter()
    esr.inclusion_log_prob(None)
    claims = time.perf_counter() - start
    start = time.perf_counter()
    report = validate_esr(esr, progress=True)
    total = time.perf_counter() - start
    print(report)
    print(f"B={args.contexts} N={args.items} K={args.candidates} M={args.experts} method={args.method} "
          f"n={report.num_samples}: claims {claims:.1f} s, whole validation {total:.1f} s "
          f"(torch threads: {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
