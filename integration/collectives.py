"""Scenario: how many collectives of its own capg_rec takes in a step of TorchRec's sampled mode (run under torchrun).

Each rank runs the sampled on-policy step of the README: one lookup listing two samples of negatives, the
candidates drawn from the catalog of the first, the loss (CA-PG-SwR, then mean-field) on the catalog resampled with
the second, backward. It counts the all-reduces and all-gathers issued during the step (TorchRec's lookup
exchanges its rows by all-to-all, which are not counted): with the input checks on, these are the checks'
agreements; with them off (``--no-validate``) there must be none. On a CPU box every collective costs a
sizeable share of such a step (gloo: ~0.5 ms each on 2 ranks), hence the count.

Writes ``DIR/collectives_rank{r}.json``: per estimator, the count of each step.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
import torch.distributed as dist

import _harness as h
import capg_rec
from capg_rec import CAPGLoss, DrawnSample, UniformSampler, sample_candidates

SETUP = h.Setup(num_items=3_001, num_experts=1, dim=4, num_users=40)  # > 2048 items: mean-field reads a head
PER_RANK, SAMPLES, K, STEPS = 4, 64, 5, 3
COUNTED = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
           "broadcast_object_list", "reduce_scatter_tensor")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-validate", action="store_true")
    args = parser.parse_args()
    if args.no_validate:
        capg_rec.set_default_validate_args(False)
    rank, _ = h.init()
    model = h.shard(SETUP, 0.1)
    h.load(model, h.full_state(SETUP, seed=5, grid=False))
    calls = collections.Counter()
    for name in COUNTED:  # every caller looks the function up on the module at call time
        def counted(*a, _original=getattr(dist, name), _name=name, **k):
            calls[_name] += 1
            return _original(*a, **k)
        setattr(dist, name, counted)
    counts = {}
    for method in ("with_replacement", "mean_field"):
        loss_fn, per_step = CAPGLoss(K, method=method), []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            users = torch.randint(SETUP.num_users, (PER_RANK,), generator=g)
            sampler = UniformSampler(SAMPLES)
            draw, fresh = (DrawnSample(sampler.draw(SETUP.num_items, None, generator=g, device=h.device()), sampler)
                           for _ in range(2))
            listed = torch.cat([draw.ids, fresh.ids]).unique()
            calls.clear()
            kjt = model.module.with_catalog(h.user_batch(users.to(h.device())), items=listed)
            catalog = model(kjt, sample=draw)
            candidates = sample_candidates(catalog, K, generator=torch.Generator(h.device()).manual_seed(step))
            loss = loss_fn(catalog.resampled(fresh, head_items=candidates), candidates, candidates[:, :2],
                           torch.rand(PER_RANK, 2, generator=g).to(h.device()))
            loss.backward()
            per_step.append(dict(calls))
        counts[method] = per_step
    Path(args.out, f"collectives_rank{rank}.json").write_text(json.dumps(counts))
    h.teardown(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
