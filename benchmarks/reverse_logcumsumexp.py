"""The reverse log-cumsum-exp off the CPU fast path (the path of CUDA, torch.compile and torch.func) against
torch.logcumsumexp: forward + backward time, and the gradient's error against float64.

    OMP_NUM_THREADS=1 python benchmarks/reverse_logcumsumexp.py [--reps 20] [--device cpu]

Shapes ``[B, M, K + 1]`` of the PL suffix masses at B = 128 for (K, M) in (10, 1), (50, 1), (20, 2),
(200, 5); float32 inputs, the last position sliced off before the loss (so that it gets no gradient,
as in the losses). "torch" is ``torch.logcumsumexp`` of the flipped input with ``-inf`` held at the
lowest finite value (what capg_rec used before); "capg_rec" is ``_ReverseLogCumSumExp``, whose
backward is its own. Times are medians of ``--reps`` calls after 3; errors are the largest absolute
difference of the gradient from a float64 ``torch.logcumsumexp``, for standard normals times each spread.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from capg_rec._numerics import _ReverseLogCumSumExp

SHAPES = [(128, 1, 11), (128, 1, 51), (128, 2, 21), (128, 5, 201)]
SPREADS = [1.0, 300.0, 1e4]


def torch_reverse(x: Tensor) -> Tensor:
    lowest = torch.finfo(x.dtype).min
    out = torch.logcumsumexp(torch.where(x > -math.inf, x, lowest).flip(-1), -1).flip(-1)
    return torch.where(out > lowest / 2, out, -math.inf)


def ours(x: Tensor) -> Tensor:
    return _ReverseLogCumSumExp.apply(x, x.dim() - 1)


def time_ms(fn: Callable[[Tensor], Tensor], x: Tensor, reps: int) -> float:
    times = []
    for i in range(reps + 3):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(x)[..., :-1].sum().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        x.grad = None
    return 1e3 * statistics.median(times[3:])


def grad_error(fn: Callable[[Tensor], Tensor], spread: float, device: torch.device) -> float:
    g = torch.Generator().manual_seed(13)
    x = (spread * torch.randn(4, 2, 30, generator=g)).to(device)
    v = torch.randn(4, 2, 29, generator=g).to(device)
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    (got,) = torch.autograd.grad(fn(x32)[..., :-1], x32, v)
    (want,) = torch.autograd.grad(torch.logcumsumexp(x64.flip(-1), -1).flip(-1)[..., :-1], x64, v.double())
    return float((got.double() - want).abs().max())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    torch.set_num_threads(1)
    device = torch.device(args.device)
    print("| shape | torch ms | capg_rec ms | ratio |\n|---|---|---|---|")
    for shape in SHAPES:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
        old, new = time_ms(torch_reverse, x, args.reps), time_ms(ours, x, args.reps)
        print(f"| {list(shape)} | {old:.3f} | {new:.3f} | {new / old:.2f} |")
    print("\n| spread | torch gradient error | capg_rec gradient error |\n|---|---|---|")
    for spread in SPREADS:
        print(f"| {spread:g} | {grad_error(torch_reverse, spread, device):.2g} | "
              f"{grad_error(ours, spread, device):.2g} |")


if __name__ == "__main__":
    main()
