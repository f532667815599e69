"""The retriever's sampled mode, sharded: one step equals one process's step over every rank's batch.

Run with ``torchrun --nproc_per_node=W integration/sampled.py --out DIR``. Each rank draws its own
negative sample (uniform over the whole catalog) and head (its users' named items), lists them with
``with_catalog(features, items)`` so that TorchRec looks their rows up wherever they live, and gets a
``SampledCatalog`` for its users. Every rank also builds the retriever unsharded and, in one process,
rebuilds every rank's batch, sample and head: the candidates drawn, the catalog's sums before the
step, and every table row after one CA-PG step (fused SGD on the shards; in the reference the mean of
the ranks' losses, since TorchRec averages the lookups' gradients over the ranks as DDP does) must
agree. A head id that one rank did not list, and an id one rank asks of its catalog without having
listed it, must raise the same ``ValueError`` on every rank; a draw that one rank's head and sample
cannot fill, and a resampled catalog whose sampler is not a listed sample on one rank, must raise on every
rank, and so must a loss naming an item one rank did not list and a resampled catalog whose head holds one; an
index head one slot short on one rank gives every rank the same exact_top; an IndexHead on a rank without users
gives it none and keeps the ranks in step. The check collectives of one validated on-policy step are counted.
Writes ``DIR/sampled_rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import _harness as h
from capg_rec import CAPGLoss, DrawnSample, UniformSampler, sample_candidates
from capg_rec.torchrec import IndexHead

SETUP = h.Setup(num_items=3_001, num_experts=2, dim=4, num_users=40, temperature=0.5)
CANDIDATES, SHOWN, PER_RANK, SAMPLES, HEAD, LR, INDEX_HEAD = 6, 2, 4, 400, 30, 0.5, 7
METHODS = ("mean_field", "with_replacement")


def rank_batch(rank: int) -> tuple[torch.Tensor, DrawnSample, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s users, sample, head and listed ids (any process can rebuild any rank's)."""
    g = torch.Generator().manual_seed(100 + rank)
    users = torch.randint(SETUP.num_users, (PER_RANK,), generator=g)
    sampler = UniformSampler(SAMPLES)
    sample = DrawnSample(sampler.draw(SETUP.num_items, None, generator=g, device=torch.device("cpu")), sampler)
    head = torch.stack([torch.randperm(SETUP.num_items, generator=g)[:HEAD] for _ in range(PER_RANK)])
    head[0, -3:] = -1
    listed = torch.cat([sample.ids, head.flatten()]).unique()
    return users, sample, head, listed[listed >= 0]


def catalog_of(model, users, sample, head, listed, index_items=None):
    retriever = getattr(model, "module", model)
    kjt = retriever.with_catalog(h.user_batch(users.to(h.device())), items=listed.to(h.device()))
    return model(kjt, sample=sample, head_items=head.to(h.device()), index_items=index_items)


def step(model, users, sample, head, listed, rank: int, method: str):
    """One rank's batch: its catalog, candidates and CA-PG loss."""
    cat = catalog_of(model, users, sample, head, listed)
    cand = sample_candidates(cat, CANDIDATES, generator=torch.Generator().manual_seed(300 + rank))
    rewards = torch.sin(users.to(cand.device).unsqueeze(1) * 1.3 + cand[:, :SHOWN] * 0.37) + 1.0
    return cat, cand, CAPGLoss(CANDIDATES, method=method)(cat, cand, cand[:, :SHOWN], rewards)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.cpu() - want.cpu()).abs().max() / want.abs().max().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world = h.init()
    state = h.full_state(SETUP, seed=5, grid=False)
    errors: dict[str, float] = {}
    messages: list[str] = []
    model = h.shard(SETUP, LR)
    batches = [rank_batch(r) for r in range(world)]
    for method in METHODS:
        reference = h.build(SETUP, device=str(h.device()))
        h.load(model, state)
        h.load(reference, state)
        cat, cand, loss = step(model, *batches[rank], rank, method)
        exclude = batches[rank][2][:, :5].to(h.device())
        total = 0.0
        for r in range(world):  # every rank's loss on the reference
            ref_cat, ref_cand, ref_loss = step(reference, *batches[r], r, method)
            total = total + ref_loss
            if r == rank:
                errors[f"{method}/candidates"] = 0.0 if torch.equal(cand, ref_cand) else float("inf")
                errors[f"{method}/log_power_sums"] = _rel(cat.log_power_sums(exclude, 3),
                                                          ref_cat.log_power_sums(exclude, 3))
                errors[f"{method}/loss"] = _rel(loss.detach(), ref_loss.detach())
        loss.backward()
        (total / world).backward()  # TorchRec divides the lookups' gradients by the world size, as DDP averages
        torch.optim.SGD(reference.parameters(), lr=LR).step()
        for key, err in h.max_shard_error(model, reference).items():
            errors[f"{method}/after_step/{key}"] = err
        for key, err in h.max_shard_error(model, reference, base=state).items():
            errors[f"{method}/update/{key}"] = err * 1e-2  # the update to 1e-3 of its size
        model.zero_grad(set_to_none=True)
    # collective refusals: one rank's mistake raises the same error on every rank
    users, sample, head, listed = batches[rank]
    bad_head = head.clone()
    if rank == world - 1:
        bad_head[1, 0] = int(torch.isin(torch.arange(SETUP.num_items), listed, invert=True).nonzero()[0])
    try:
        catalog_of(model, users, sample, bad_head, listed)
    except ValueError as err:
        messages.append(str(err))
    cat = catalog_of(model, users, sample, head, listed)
    asked = torch.where(head >= 0, head, head[:, :1])
    if rank == 0:
        asked[2, 1] = int(torch.isin(torch.arange(SETUP.num_items), listed, invert=True).nonzero()[0])
    try:
        cat.gather(asked.to(h.device()))
    except ValueError as err:
        messages.append(str(err))
    # a draw that one rank's head and sample cannot fill (all of them excluded there) raises on every rank
    draws: list[str] = []
    excluded = listed.expand(PER_RANK, -1) if rank == world - 1 else None
    try:
        cat.top_items(CANDIDATES, experts=[0], exclude=excluded, perturb=True)
    except ValueError as err:
        draws.append(str(err))
    # the loss's catalog resampled with a sampler that is not a listed DrawnSample on one rank: every rank raises
    try:
        cat.resampled(UniformSampler(10) if rank == 0 else sample)
    except TypeError as err:
        messages.append(str(err))
    # an item one rank's loss names but did not list: every rank raises, in the loss's one agreement
    losses: list[str] = []
    cand = sample_candidates(cat, CANDIDATES, generator=torch.Generator().manual_seed(5))
    if rank == 0:
        cand[1, 0] = int(torch.isin(torch.arange(SETUP.num_items), listed, invert=True).nonzero()[0])
    try:
        CAPGLoss(CANDIDATES, method="with_replacement")(cat, cand, cand[:, :SHOWN], torch.ones(PER_RANK, SHOWN))
    except ValueError as err:
        losses.append(str(err))
    try:  # a caller that goes on after that error: the items are checked again (and raise again) on every rank
        cat.gather(cand)
    except ValueError as err:
        losses.append(str(err))
    # a resampled catalog whose head names an item rank 1 did not list: every rank raises
    cand = sample_candidates(cat, CANDIDATES, generator=torch.Generator().manual_seed(5))
    if rank == world - 1:
        cand[0, 0] = int(torch.isin(torch.arange(SETUP.num_items), listed, invert=True).nonzero()[0])
    try:
        cat.resampled(sample, head_items=cand)
    except ValueError as err:
        messages.append(str(err))
    collectives = {method: _check_collectives(model, users, sample, head, listed, method) for method in METHODS}
    # an index head one slot short on rank 0 only (-1: an approximate index found fewer): every rank reads the
    # least exact_top, so that the methods take one path everywhere
    found = IndexHead(model.module, INDEX_HEAD)(h.user_batch(users.to(h.device())))
    if rank == 0:
        found[0, 0, -1] = -1
    ids = found.flatten().cpu()
    exact_top = catalog_of(model, users, sample, head, torch.cat([listed, ids[ids >= 0]]).unique(),
                           index_items=found).exact_top
    # an index head on every rank, the last one without users: its lookups still take part, and it gets none
    mine = users if rank < world - 1 else users[:0]
    found = IndexHead(model.module, INDEX_HEAD)(h.user_batch(mine.to(h.device())))
    dist.barrier()  # the ranks are still in step
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"sampled_rank{rank}.json").write_text(json.dumps(
        {"world_size": world, "errors": errors, "messages": messages, "draws": draws,
         "index_head_shape": list(found.shape), "exact_top": exact_top, "losses": losses,
         "collectives": collectives}, indent=1))
    h.teardown(model)
    return 0 if max(errors.values()) <= 1e-5 and len(messages) == 4 and len(draws) == 1 and len(losses) == 2 else 1


def _check_collectives(model, users, sample, head, listed, method: str) -> int:
    """The all-gathers and all-reduces (the checks' collectives; TorchRec's lookups are all-to-alls) of one
    validated on-policy step of CA-PG by ``method``: forward, draw, the loss's catalog resampled with the
    candidates as its head, loss."""
    count = 0
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def counted(collective):
        def call(*args, **kwargs):
            nonlocal count
            count += 1
            return collective(*args, **kwargs)
        return call

    for name, collective in originals.items():
        setattr(dist, name, counted(collective))
    try:
        cat = catalog_of(model, users, sample, head, listed)
        cand = sample_candidates(cat, CANDIDATES, generator=torch.Generator().manual_seed(6))
        CAPGLoss(CANDIDATES, method=method)(cat.resampled(sample, head_items=cand), cand, cand[:, :SHOWN],
                                            torch.ones(PER_RANK, SHOWN))
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
    return count


if __name__ == "__main__":
    sys.exit(main())
