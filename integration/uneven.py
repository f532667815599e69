"""The sampled mode's checks on ranks whose batches differ: they pass together or raise together, never hang.

Run with ``torchrun --nproc_per_node=2 integration/uneven.py --out DIR``. A validated loss takes its
checks on each rank and agrees on them in one collective; how many checks a rank takes depends on its
data (its batch size picks the path of the candidates' checks, a batch of no users skips some, an
out-of-range id others), so the agreement must not depend on that number. Each case runs on both
ranks with a collective timeout, so that a hang fails the case instead of the job:

* ``empty``: rank 1 has no users; CA-PG (mean-field, SwR) on a resampled catalog passes on both, also when rank
  1's head and sample hold fewer items than mean-field's head (``empty/mean_field_small``), and so do draws
  larger than rank 1's head and sample (``empty/draw``, ``empty/greedy``: none at all);
* ``wide``: rank 0 has 1,500 users (its checks take another path than rank 1's 4), valid input: passes;
* ``pad``: rank 0's logged candidates hold a ``-1``: a ``ValueError`` on both (CA-PG-SwR and V-PG-SwR);
* ``nothing_listed``: rank 1 listed no rows (an empty sample, a head of ``-1`` pads) and its loss names
  items: a ``ValueError`` on both;
* ``rewritten``: after a validated loss, rank 0 alone rewrites a candidate in place (to a listed id), then
  both gather the candidates: both return;
* on the whole (sharded) catalog: ``exact/empty`` (rank 1 has no users; CA-PG by the exact method, backward
  included) and ``propensity/empty`` (logged propensities, ε = 0.1) pass on both; ``propensity/bad_id`` (rank 0
  logged a shown id outside the catalog) and ``uniform_short`` (ε = 1 and a row of rank 0 with fewer unmasked
  items than K) raise on both;
* ``short_pool``: rank 1's head and sample hold fewer slots than the draw's K: a ``ValueError`` on both; with
  no users on rank 1 (``short_pool/empty``) there is nothing to draw there, and both pass;
* ``k_draw``: the ranks draw different numbers of candidates from the whole catalog: a ``ValueError`` on both;
  ``k_draw/sampled``: the same from their sampled catalogs; ``agree_only/*``: a ``SampledCatalog`` that the ranks
  share through ``agree`` alone, too small on rank 1 for a draw or for mean-field's head: the error on both;
  ``head_then_other_k``: after mean-field read its head (``/whole``: the whole catalog), the ranks ask the catalog for
  different numbers of best items: both pass;
* ``dense_rows`` / ``dense_dtype``: a retriever with a user tower, whose ``dense`` input has a row too few on
  rank 1, or another dtype than the tower's: the error on both; ``user_vectors_dense``: the same row too few in
  the export's ``user_vectors``; ``user_vectors_catalog``: the catalog feature in rank 1's ``user_vectors``;
* ``structure/*``: rank 1 passes a loss malformed input (rewards of the wrong shape, float ``chosen``, candidates
  with a row too few, or a column fewer than the loss module's K), in the sampled mode and on the whole catalog (with
  masked items too: ``/masked``): its own error there, a ``ValueError`` on rank 0 that says so (found by review: with
  as many checks on both ranks, rank 0 named a check of its own that had passed);
* ``short_sample``: rank 1's DrawnSample holds 3 of its uniform sampler's ids: refused on both ranks;
* ``masked/range``, ``masked/float``: rank 1's ``masked_items`` in the sampled mode hold an id outside the catalog, or
  are floats: the error on both;
* ``chunk_default``, ``chunk_default/empty``: batches of 3 and 1 (or 0) users, the default chunk under a GPU's rule:
  the same on both ranks, from the 4 (or 3) users every rank scores (found by review: from each rank's own);
* ``uneven_sum``: batches of 3 and 1 users, the loss summed and scaled by W / B_total: one step updates the tables
  as one process over the 4 users does (the README's recipe for uneven batches);
* ``ties``: a row-wise item table whose rows are all the same: the greedy draw names the lowest ids, as on one
  process;
* ``catalog_arguments/*``: rank 1 passes the whole sharded catalog's ``top_items`` a K above N, another K than
  rank 0's, another ``perturb`` or an expert it does not have, or ``log_power_sums`` no powers: the error on both;
* ``key_order/*``: a batch whose keys come in another order than the first batch's (TorchRec's sharded lookup
  would read it in the first order), on rank 1 alone or on both: a ``ValueError`` on both;
* ``baseline_dtype``: the baselines over float32 rewards on rank 0 and float64 ones on rank 1: one mean on both;
* ``arguments/*``: rank 1 passes a draw a bad argument (K of 0, above N or a float; a generator that is not one),
  in the sampled mode and on the whole catalog, and to ``greedy_candidates`` and ``explore_candidates``: its own
  error there, a ``ValueError`` on rank 0.

Writes ``DIR/uneven_rank{r}.json``: each case's outcome, ``"ok"`` or the exception's class and message.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

import _harness as h
from capg_rec import CAPGLoss, DrawnSample, InclusionMethod, NegativeSampler, SampledCatalog, UniformSampler, \
    VPGLoss, WithReplacement, greedy_candidates, inclusion_log_prob, sample_candidates
from capg_rec.logs import explore_candidates, log_propensities
from capg_rec.torchrec import ContextBaseline, global_mean_baseline

SETUP = h.Setup(num_items=3_001, num_experts=2, dim=4, num_users=40, temperature=0.5)
PER_RANK, WIDE, SAMPLES, HEAD, K = 4, 1_500, 400, 30, 5


class Cut(NegativeSampler):
    """A uniform sampler's expected counts for a sample cut short on one rank (fewer ids than the draw, or none): a
    sampler of the user's own, whose draw's size the library does not know (a ``UniformSampler``'s DrawnSample must
    hold its whole draw)."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def draw(self, num_items, batch_items, *, generator, device):
        return torch.randint(num_items, (self.num_samples,), generator=generator, device=device)

    def log_expected_count(self, ids, num_items, batch_items):
        return torch.full(ids.shape, math.log(self.num_samples / num_items), dtype=torch.float64, device=ids.device)


def batch(rank: int, size: int) -> tuple[torch.Tensor, DrawnSample, torch.Tensor, torch.Tensor]:
    """``size`` users of rank ``rank``, a sample, a head of logged items per user (its first K: the logged
    candidates) and the ids to list."""
    g = torch.Generator().manual_seed(100 + rank)
    users = torch.randint(SETUP.num_users, (size,), generator=g)
    sampler = UniformSampler(SAMPLES)
    sample = DrawnSample(sampler.draw(SETUP.num_items, None, generator=g, device=torch.device("cpu")), sampler)
    head = torch.rand(size, SETUP.num_items, generator=g).argsort(dim=1)[:, :HEAD]  # distinct in a row
    return users, sample, head, torch.cat([sample.ids, head.flatten()]).unique()


def catalog(model, users, sample, head, listed, masked_items=None):
    kjt = model.module.with_catalog(h.user_batch(users.to(h.device())), items=listed.to(h.device()))
    return model(kjt, sample=sample, head_items=head.to(h.device()),
                 masked_items=None if masked_items is None else masked_items.to(h.device()))


def outcome(case) -> str:
    try:
        case()
    except Exception as err:  # noqa: BLE001 - the outcome is reported, whatever it is
        return f"{type(err).__name__}: {err}"
    return "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world = h.init()
    model = h.shard(SETUP, 0.1)
    h.load(model, h.full_state(SETUP, seed=5, grid=False))
    ones = lambda rows: torch.ones(rows, 2)  # noqa: E731
    # with_catalog is a local call: its first one makes no process group (found by review: a rank that raised before
    # it left the others in new_group), the first collective does
    made, new_group = [], dist.new_group
    dist.new_group = lambda *a, **k: made.append(1) or new_group(*a, **k)
    kjt = model.module.with_catalog(h.user_batch(batch(rank, PER_RANK)[0].to(h.device())))
    groups_of_with_catalog = len(made)
    model(kjt)
    dist.new_group = new_group
    with_catalog_local = "ok" if (groups_of_with_catalog, len(made)) == (0, 1) else f"groups made {made}"

    def empty(method: str, small: bool = False):
        def case():  # small: rank 1's head and sample (6 candidates, 3 negatives) hold fewer than mean-field's head
            users, sample, head, listed = batch(rank, 0 if rank == 1 else PER_RANK)
            if small and rank == 1:
                sample = DrawnSample(sample.ids[:3], UniformSampler(3))
            cat = catalog(model, users, sample, head, listed)
            cand = sample_candidates(cat, 6, generator=torch.Generator().manual_seed(3))
            loss = CAPGLoss(6, method=method)(cat.resampled(sample, head_items=cand), cand, cand[:, :2],
                                              ones(users.shape[0]))
            loss.backward()
        return case

    def empty_draw(greedy: bool):
        def case():  # rank 1 has no users, and its head and sample fewer slots than the draw (or none)
            users, sample, head, listed = batch(rank, 0 if rank == 1 else PER_RANK)
            if rank == 1:
                sample = DrawnSample(sample.ids[:0 if greedy else 3], Cut(3))
                listed = listed[:0] if greedy else listed
            head = None if greedy else head  # greedy: no head anywhere, and rank 1 lists nothing
            kjt = model.module.with_catalog(h.user_batch(users.to(h.device())), items=listed.to(h.device()))
            cat = model(kjt, sample=sample, head_items=None if head is None else head.to(h.device()))
            if greedy:
                return greedy_candidates(cat, 6)
            return sample_candidates(cat, 80, generator=torch.Generator().manual_seed(3))  # 2 blocks of 40
        return case

    def wide():
        users, sample, head, listed = batch(rank, WIDE if rank == 0 else PER_RANK)
        cand = head[:, :K].clone()
        CAPGLoss(K, method="with_replacement")(catalog(model, users, sample, head, listed), cand, cand[:, :2],
                                               ones(users.shape[0]))

    def pad(loss_fn):
        def case():
            users, sample, head, listed = batch(rank, PER_RANK)
            cand = head[:, :K].clone()
            if rank == 0:
                cand[1, -1] = -1
            loss_fn(catalog(model, users, sample, head, listed), cand, cand[:, :2], ones(PER_RANK))
        return case

    def short_sample():
        users, sample, head, listed = batch(rank, PER_RANK)
        if rank == 1:  # 3 of the uniform sampler's 400 ids: each estimated sum would be 3/400 of the sample's part
            sample = DrawnSample(sample.ids[:3], UniformSampler(SAMPLES))
        cand = head[:, :K].clone()
        CAPGLoss(K, method="with_replacement")(catalog(model, users, sample, head, listed), cand, cand[:, :2],
                                               ones(PER_RANK))

    def nothing_listed():
        users, sample, head, listed = batch(rank, PER_RANK)
        cand = head[:, :K].clone()
        if rank == 1:
            sample, head, listed = DrawnSample(listed[:0], Cut(1)), torch.full_like(head, -1), listed[:0]
        CAPGLoss(K, method="with_replacement")(catalog(model, users, sample, head, listed), cand, cand[:, :2],
                                               ones(PER_RANK))

    def rewritten():
        users, sample, head, listed = batch(rank, PER_RANK)
        cand = head[:, :K].clone()
        cat = catalog(model, users, sample, head, listed)
        CAPGLoss(K, method="with_replacement")(cat, cand, cand[:, :2], ones(PER_RANK))
        if rank == 0:
            cand[0, 0] = cand[0, 1].item()  # still a listed id
        cat.gather(cand)

    def full(users, masked=None):  # the whole catalog, sharded
        kjt = model.module.with_catalog(h.user_batch(users.to(h.device())))
        return model(kjt, masked_items=None if masked is None else masked.to(h.device()))

    def exact_empty():
        users = batch(rank, 0 if rank == 1 else PER_RANK)[0]
        cat = full(users)
        cand = sample_candidates(cat, K, generator=torch.Generator().manual_seed(3))
        CAPGLoss(K, method="exact")(cat, cand, cand[:, :2], ones(users.shape[0])).backward()

    def propensity_empty():
        users = batch(rank, 0 if rank == 1 else PER_RANK)[0]
        cat = full(users)
        cand = explore_candidates(cat, K, epsilon=0.1, generator=torch.Generator().manual_seed(3))
        log_propensities(cat, cand, cand[:, :2], epsilon=0.1)

    def propensity_bad_id():
        users = batch(rank, PER_RANK)[0]
        cat = full(users)
        cand = sample_candidates(cat, K, generator=torch.Generator().manual_seed(3))
        shown = cand[:, :2].clone()
        if rank == 0:
            shown[0, 0] = SETUP.num_items
        log_propensities(cat, cand, shown)

    def uniform_short():
        users = batch(rank, PER_RANK)[0]
        masked = torch.full((PER_RANK, SETUP.num_items - 4), -1)
        if rank == 0:
            masked[0] = torch.arange(4, SETUP.num_items)  # row 0 keeps 4 items, fewer than K
        explore_candidates(full(users, masked), K, epsilon=1.0, generator=torch.Generator().manual_seed(3))

    def short_pool(size: int):
        def case():
            users, sample, head, listed = batch(rank, size if rank == 1 else PER_RANK)
            if rank == 1:
                sample = DrawnSample(sample.ids[:3], UniformSampler(3))  # head and sample: 33 slots, fewer than 40
            sample_candidates(catalog(model, users, sample, head, listed), 40)
        return case

    def k_draw():
        sample_candidates(full(batch(rank, PER_RANK)[0]), K + rank, generator=torch.Generator().manual_seed(3))

    class Shared(SampledCatalog):  # shared through the public agree hook alone
        def agree(self, passed):
            least = passed.to(torch.int64)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            return least.bool()

    def agree_only(method: str | None):
        def case():  # rank 1's head and sample are too small for the draw (K = 8) or mean-field's head (16 of 3001)
            g = torch.Generator().manual_seed(rank)
            user, item = torch.randn(2, 4, generator=g), torch.randn(SETUP.num_items, 4, generator=g)
            cat = Shared(user, item, sampler=UniformSampler(60 if rank == 0 else 5 if method is None else 10),
                         generator=g)
            if method is None:
                sample_candidates(cat, 8, generator=torch.Generator().manual_seed(0))
            else:
                inclusion_log_prob(cat, torch.zeros(2, 1, dtype=torch.long), 2, method=method)
        return case

    class SharedAlike(Shared):  # and through _least, as the sampled mode's catalogs
        def _least(self, *values):
            least = torch.tensor(values)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            return tuple(least.tolist())

    def head_then_other_k(whole: bool):
        def case():
            if whole:  # 6 items, all in the sample: mean-field reads them whole
                g = torch.Generator().manual_seed(rank)
                cat = SharedAlike(torch.randn(2, 4, generator=g), torch.randn(6, 4, generator=g),
                                  sampler=UniformSampler(200), generator=g)
                inclusion_log_prob(cat, torch.zeros(2, 1, dtype=torch.long), 2, method="mean_field")
                cat.top_items(6 - rank)
                return
            users, sample, head, listed = batch(rank, PER_RANK)
            cat = catalog(model, users, sample, head, listed).resampled(sample, head_items=head[:, :6])
            inclusion_log_prob(cat, head[:, :2], 6, method="mean_field")  # reads each expert's best 27 (8·3 + 6 - 3)
            cat.top_items(27 + rank)  # each rank checks this read of its own
        return case

    def k_draw_sampled():
        sample_candidates(catalog(model, *batch(rank, PER_RANK)), K + rank, generator=torch.Generator().manual_seed(3))

    towered = h.shard(dataclasses.replace(SETUP, tower=True), 0.1)

    def dense(rows: int, dtype: torch.dtype):
        def case():  # the tower takes the pooled user features and dense's columns (none here)
            users = batch(rank, PER_RANK)[0]
            kjt = towered.module.with_catalog(h.user_batch(users.to(h.device())))
            towered(kjt, torch.zeros(rows, 0, dtype=dtype if rank == 1 else torch.float32, device=h.device()))
        return case

    def structure(what: str, sampled: bool, masked: bool = False):
        def case():
            users, sample, head, listed = batch(rank, PER_RANK)
            masks = torch.tensor([[7, -1]] * PER_RANK) if masked else None
            cat = catalog(model, users, sample, head, listed) if sampled else full(users, masks)
            g = torch.Generator().manual_seed(3)
            cand = head[:, :K].clone() if sampled else sample_candidates(cat, K, generator=g)
            chosen, rewards = cand[:, :2], ones(PER_RANK)
            if rank == 1:
                if what == "rewards":
                    rewards = rewards[:, :1]
                elif what == "chosen":
                    chosen = chosen.float()
                elif what == "width":  # a column fewer than the module's K
                    cand = cand[:, 1:]
                else:
                    cand = cand[1:]
            CAPGLoss(K)(cat, cand, chosen, rewards).backward()
        return case

    def bad_draw(what: str, where: str):
        def case():  # rank 1 passes the draw a bad argument
            users, sample, head, listed = batch(rank, PER_RANK)
            cat = catalog(model, users, sample, head, listed) if where == "sampled" else full(users)
            k, g = K, torch.Generator().manual_seed(3)
            if rank == 1:
                k = {"k_zero": 0, "k_above_n": SETUP.num_items + 1, "k_float": 2.0}.get(what, K)
                g = "x" if what == "generator" else g
            if where == "greedy":
                greedy_candidates(cat, k)
            elif where == "explore":
                explore_candidates(cat, k, epsilon=0.1, generator=g)
            else:
                sample_candidates(cat, k, generator=g)
        return case

    def uneven_sum():  # batches of 3 and 1 users: reduction "sum" times W / B_total steps as one process
        setup, lr, k, sizes = h.Setup(num_items=50, num_experts=1, dim=4, num_users=16), 0.5, 3, (3, 1)
        state = h.full_state(setup, 0)
        stepped = h.shard(setup, lr=lr)
        h.load(stepped, state)
        ref = h.build(setup)
        ref.load_state_dict(state)
        total = sum(sizes)
        users, mine = torch.arange(total), slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        g = torch.Generator().manual_seed(3)
        whole = ref(ref.with_catalog(h.user_batch(users)))
        cands = sample_candidates(whole, k, generator=g)
        chosen, rewards = cands[:, :1], torch.rand(total, 1, generator=g)
        CAPGLoss(k)(whole, cands, chosen, rewards).backward()
        with torch.no_grad():
            for p in ref.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        cat = stepped(stepped.module.with_catalog(h.user_batch(users[mine].to(h.device()))))
        loss = CAPGLoss(k, reduction="sum")(cat, cands[mine].to(h.device()), chosen[mine].to(h.device()),
                                            rewards[mine].to(h.device()))
        (loss * (dist.get_world_size() / total)).backward()
        errors = h.max_shard_error(stepped, ref, base=state)
        if max(errors.values()) > 1e-4:
            raise AssertionError(f"updates differ from one process: {errors}")

    def chunk_default(sizes: tuple[int, int]):
        def case():  # the default chunk under a GPU's rule (read off the device's type): from every rank's users
            import capg_rec.torchrec.catalog as sharded
            rule = sharded.chunk_items
            sharded.chunk_items = lambda size, rows, device: rule(size, rows, torch.device("cuda"))
            try:
                cat = sharded.ShardedEmbeddingCatalog(torch.randn(sizes[rank], 2, 4), torch.randn(5, 2, 4),
                                                      num_items=10, row_offset=5 * rank, process_group=dist.group.WORLD)
            finally:
                sharded.chunk_items = rule
            every = [0, 0]
            dist.all_gather_object(every, cat.chunk_size)
            expected = rule(None, 2 * sum(sizes), torch.device("cuda"))  # 2 experts
            if every != [expected, expected]:
                raise AssertionError(f"chunk sizes {every}, expected {expected} on both")
        return case

    def structure_one_expert(what: str):
        def case():  # as ``structure``, on a one-expert whole catalog with masked items (a review's set-up)
            setup = h.Setup(num_items=40, num_experts=1, dim=4, num_users=16)
            net = h.shard(setup, lr=0.1)
            users = torch.arange(3) + 3 * rank
            cat = net(net.module.with_catalog(h.user_batch(users.to(h.device()))),
                      masked_items=torch.tensor([[5, -1]] * 3).to(h.device()))
            cand = sample_candidates(cat, 6, generator=torch.Generator().manual_seed(3))
            chosen, rewards = cand[:, :2], torch.ones(3, 2, device=cand.device)
            if rank == 1:
                rewards = rewards[:, :1] if what == "rewards" else rewards[:-1]
            CAPGLoss(6)(cat, cand, chosen, rewards).backward()
        return case

    def masked(what: str):
        def case():  # rank 1's masks in the sampled mode: an id outside the catalog, or floats
            users, sample, head, listed = batch(rank, PER_RANK)
            masks = torch.full((PER_RANK, 2), -1)
            if rank == 1:
                masks = masks.float() if what == "float" else masks.fill_(SETUP.num_items + 7)
            catalog(model, users, sample, head, listed, masks)
        return case

    def user_vectors_catalog():  # rank 1 passes the export's user side the catalog feature too
        users = batch(rank, PER_RANK)[0].to(h.device())
        features = model.module.with_catalog(h.user_batch(users)) if rank == 1 else h.user_batch(users)
        model.module.user_vectors(features)

    def ties():  # every item row the same (cold-start rows): every score ties, and ties go to the lower id
        setup = h.Setup(num_items=40, num_experts=1, dim=4, num_users=16)
        state = h.full_state(setup, 0)
        state[next(key for key in state if "item_table" in key)][:] = 0.25
        tied = h.shard(setup, lr=0.1)
        h.load(tied, state)
        ref = h.build(setup)
        ref.load_state_dict(state)
        users, mine = torch.arange(4), slice(2 * rank, 2 * rank + 2)
        expected = greedy_candidates(ref(ref.with_catalog(h.user_batch(users))), 5)[mine]
        got = greedy_candidates(tied(tied.module.with_catalog(h.user_batch(users[mine].to(h.device())))), 5).cpu()
        if not torch.equal(got, expected):
            raise AssertionError(f"sharded {got.tolist()}, one process {expected.tolist()}")

    def user_vectors_dense():  # the serving export's user side: a row too few on rank 1
        users = batch(rank, PER_RANK)[0]
        towered.module.user_vectors(h.user_batch(users.to(h.device())), torch.zeros(PER_RANK - rank, 0,
                                                                                     device=h.device()))

    class Squeezed(InclusionMethod):  # a user's method whose .squeeze() drops rank 1's one row
        is_probability = False

        def log_inclusion(self, catalog, items, runs):
            return WithReplacement().log_inclusion(catalog, items, runs).squeeze()

    def user_method_shape():  # found by review: rank 1 raised alone, rank 0 waited in the values' agreement
        users = batch(rank, 1 if rank == 1 else PER_RANK)[0]
        cat = full(users)
        cand = sample_candidates(cat, K, generator=torch.Generator().manual_seed(3))
        CAPGLoss(K, method=Squeezed())(cat, cand, cand[:, :2], ones(users.shape[0]))

    def catalog_arguments(what: str):
        def case():  # rank 1 passes the whole sharded catalog's own methods a bad or another argument
            cat, other = full(batch(rank, PER_RANK)[0]), rank == 1
            if what == "k":
                cat.top_items(SETUP.num_items + 1 if other else 3)
            elif what == "other_k":
                cat.top_items(3 + rank)
            elif what == "other_perturb":  # found by review: a perturbed draw's seed exchange met the other's gathers
                cat.top_items(3, perturb=other, generator=torch.Generator().manual_seed(1))
            elif what == "experts":
                cat.top_items(3, experts=[5] if other else [0])
            else:
                cat.log_power_sums(num_powers=0 if other else 1)
        return case

    def key_order(one_rank: bool):
        def case():  # the usual keys in another order (the catalog feature first), on rank 1 alone or on both
            kjt = model.module.with_catalog(h.user_batch(batch(rank, PER_RANK)[0].to(h.device())))
            model(kjt.permute([1, 0]) if rank == 1 or not one_rank else kjt)
        return case

    def baseline_dtype():  # rank 1's rewards in float64, rank 0's in float32: one mean, in each rank's dtype
        rewards = torch.full((PER_RANK, 2), float(rank + 1), dtype=torch.float64 if rank == 1 else torch.float32)
        for base in (global_mean_baseline(rewards, dist.group.WORLD),
                     ContextBaseline(SETUP.num_users, process_group=dist.group.WORLD)(torch.arange(PER_RANK), rewards)):
            if base.dtype != rewards.dtype or not torch.equal(base, torch.full_like(base, 1.5)):
                raise AssertionError(f"baseline {base.tolist()} ({base.dtype}), want 1.5 ({rewards.dtype})")

    def baseline_contexts():  # rank 1 passes no contexts: refused on every rank, before the baseline's collectives
        rewards = torch.ones(PER_RANK, 2)
        ContextBaseline(SETUP.num_users, process_group=dist.group.WORLD)(
            None if rank == 1 else torch.arange(PER_RANK), rewards)

    cases = {"empty/mean_field": empty("mean_field"), "empty/with_replacement": empty("with_replacement"),
             "empty/mean_field_small": empty("mean_field", small=True), "empty/draw": empty_draw(False),
             "empty/greedy": empty_draw(True),
             "wide": wide, "pad/capg": pad(CAPGLoss(K, method="with_replacement")),
             "pad/vpg": pad(VPGLoss(K, with_replacement=True)), "nothing_listed": nothing_listed,
             "short_sample": short_sample,
             "rewritten": rewritten, "exact/empty": exact_empty, "propensity/empty": propensity_empty,
             "propensity/bad_id": propensity_bad_id, "uniform_short": uniform_short,
             "short_pool": short_pool(PER_RANK), "short_pool/empty": short_pool(0), "k_draw": k_draw,
             "k_draw/sampled": k_draw_sampled, "agree_only/draw": agree_only(None),
             "agree_only/mean_field": agree_only("mean_field"), "head_then_other_k": head_then_other_k(False),
             "head_then_other_k/whole": head_then_other_k(True),
             "dense_rows": dense(PER_RANK - rank, torch.float32), "dense_dtype": dense(PER_RANK, torch.float64),
             "user_vectors_dense": user_vectors_dense, "user_vectors_catalog": user_vectors_catalog, "ties": ties,
             "uneven_sum": uneven_sum, "masked/range": masked("range"), "masked/float": masked("float"),
             "chunk_default": chunk_default((3, 1)), "chunk_default/empty": chunk_default((3, 0)),
             **{f"structure/{what}/{where}": structure(what, where == "sampled", where == "masked")
                for what in ("rewards", "chosen", "rows", "width") for where in ("sampled", "whole", "masked")},
             **{f"structure/{what}/one_expert": structure_one_expert(what) for what in ("rewards", "rewrows")},
             **{f"arguments/{what}/{where}": bad_draw(what, where)
                for what in ("k_zero", "k_above_n", "k_float", "generator") for where in ("sampled", "whole")},
             "arguments/greedy": bad_draw("k_above_n", "greedy"), "arguments/explore": bad_draw("k_zero", "explore"),
             "user_method_shape": user_method_shape,
             **{f"catalog_arguments/{what}": catalog_arguments(what)
                for what in ("k", "other_k", "other_perturb", "experts", "powers")},
             "key_order/one_rank": key_order(True), "key_order/both": key_order(False),
             "baseline_dtype": baseline_dtype, "baseline_contexts": baseline_contexts}
    outcomes = {name: outcome(case) for name, case in cases.items()}
    outcomes["with_catalog_local"] = with_catalog_local
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"uneven_rank{rank}.json").write_text(json.dumps(outcomes, indent=1))
    h.teardown(model, towered)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
