"""TorchRec's ``TrainPipelineSparseDist`` trains the retriever exactly as a plain training loop does.

Run with ``torchrun --nproc_per_node=W integration/pipeline.py --out DIR``. Every rank builds the
same sharded train task twice from the same weights (row-wise item table and user table, fused
SGD in backward, the user tower under DDP with SGD through ``KeyedOptimizerWrapper``): one is
trained by a plain loop, the other by ``TrainPipelineSparseDist.progress`` over the same batches
(``torchrec.datasets.utils.Batch`` whose sparse features already carry the catalog sample). The
pipeline fx-traces the task; the task keeps what follows the retriever in a submodule (a leaf
of that trace). Each rank writes ``DIR/pipeline_rank{r}.json``: the largest relative difference
of the losses, rewards and candidates at every step and of every parameter shard at the end.

With ``--sampled`` the task learns from logs through the retriever's sampled mode: each batch
(:class:`LoggedBatch`) carries its users, logged candidates, shown items, rewards and propensities, and
a negative sample drawn with it, whose rows and the candidates' are listed in its sparse features (one
lookup, which the pipeline prefetches); the loss is off-policy CA-PG on the sampled catalog.

With ``--index-head`` the task learns on-policy through the sampled mode: each batch
(:class:`SampledBatch`) carries its users, two negative samples and each expert's best items from an
``IndexHead`` (an exact index over the item side, rebuilt every other batch; the head is found before the
step, as a data loader would), all listed in its sparse features: one lookup. The task draws the
candidates from the sampled catalog of the index head and the first sample, ranks them, and takes CA-PG
on the catalog ``resampled`` with the second sample and the candidates as its head. With ``--head-in-loader``
each run finds its batches' heads as it is fed, from its own weights: the pipeline fetches batch t + 2 (its
head searched while the pipeline's lookups are in flight) before step t's forward, so the plain loop finds batch
t + 2's head before its step t as well.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

import _harness as h
from capg_rec import CAPGLoss, DrawnSample, OffPolicyCAPGLoss, SampledCatalog, UniformSampler, sample_candidates
from capg_rec.torchrec import IndexHead, ShardedEmbeddingCatalog, TwoTowerRetriever

CANDIDATES, SHOWN, LR, NEGATIVES = 6, 2, 0.3, 300
INDEX_HEAD = 32  # mean-field reads each expert's best 8·3 + 3 = 27 items at K = 6, M = 2
SETUP = h.Setup(num_items=2_001, num_experts=2, dim=4, tower=True)
SAMPLED_SETUP = h.Setup(num_items=20_001, num_experts=2, dim=4, tower=True)  # beyond what mean-field reads whole


class Objective(nn.Module):
    """Sampling, a fixed ranker, rewards and the CA-PG loss: ``(catalog, users) -> (loss, (rewards, candidates))``."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)
        self.loss_fn = CAPGLoss(CANDIDATES)

    def forward(self, catalog: ShardedEmbeddingCatalog, users: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        candidates = sample_candidates(catalog, CANDIDATES, generator=self.generator)
        chosen, rewards = rank(users, candidates)
        return self.loss_fn(catalog, candidates, chosen, rewards), (rewards, candidates)


def rank(users: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """A fixed ranker: the SHOWN candidates of highest utility and their rewards (the utilities)."""
    utility = torch.sin(users.unsqueeze(1) * 12.9898 + candidates * 78.233) * 0.5 + 0.5  # on their device
    top = utility.topk(SHOWN, dim=1)
    return candidates.gather(1, top.indices), top.values


class Task(nn.Module):
    """``forward(batch) -> (loss, outputs)``, the contract of TorchRec's train pipelines."""

    def __init__(self, retriever: TwoTowerRetriever) -> None:
        super().__init__()
        self.retriever, self.objective = retriever, Objective()

    def forward(self, batch: Batch) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        return self.objective(self.retriever(batch.sparse_features), batch.labels)


class _ListedBatch(Pipelineable):
    """A batch whose ``sparse_features`` list its rows and whose other tensors ``_tensors()`` names."""

    sparse_features: KeyedJaggedTensor

    def _tensors(self) -> list[Tensor]:
        raise NotImplementedError

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse_features.record_stream(stream)
        for t in self._tensors():
            t.record_stream(stream)


class LoggedBatch(_ListedBatch):
    """Logged requests of B users and the negative sample drawn with them: ``sparse_features`` (the users,
    with the sample's and the candidates' ids listed by ``with_catalog``), ``sample``, ``candidates [B, K]``,
    ``chosen [B, L]``, ``rewards [B, L]``, ``log_propensity [B, L]``."""

    def __init__(self, sparse_features: KeyedJaggedTensor, sample: DrawnSample, candidates: Tensor, chosen: Tensor,
                 rewards: Tensor, log_propensity: Tensor) -> None:
        self.sparse_features, self.sample, self.candidates = sparse_features, sample, candidates
        self.chosen, self.rewards, self.log_propensity = chosen, rewards, log_propensity

    def _tensors(self) -> list[Tensor]:
        return [self.sample.ids, self.candidates, self.chosen, self.rewards, self.log_propensity]

    def to(self, device: torch.device, non_blocking: bool = False) -> LoggedBatch:
        ids, *rest = (t.to(device, non_blocking=non_blocking) for t in self._tensors())
        return LoggedBatch(self.sparse_features.to(device, non_blocking=non_blocking),
                           DrawnSample(ids, self.sample.sampler, self.sample.batch_items), *rest)


class OffPolicyObjective(nn.Module):
    """``(catalog, batch) -> (loss, (loss, candidates))``: off-policy CA-PG on the sampled catalog."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = OffPolicyCAPGLoss(CANDIDATES)

    def forward(self, catalog: SampledCatalog, batch: LoggedBatch) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        loss = self.loss_fn(catalog, batch.candidates, batch.chosen, batch.rewards, batch.log_propensity)
        return loss, (loss.detach(), batch.candidates)


class SampledTask(nn.Module):
    """``forward(batch) -> (loss, outputs)`` from logs, through the retriever's sampled mode."""

    def __init__(self, retriever: TwoTowerRetriever) -> None:
        super().__init__()
        self.retriever, self.objective = retriever, OffPolicyObjective()

    def forward(self, batch: LoggedBatch) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        catalog = self.retriever(batch.sparse_features, sample=batch.sample, head_items=batch.candidates)
        return self.objective(catalog, batch)


class SampledBatch(_ListedBatch):
    """B users, negative samples to draw from and for the loss, and the users' index head ``[B, M, H]``, all
    listed in ``sparse_features``."""

    def __init__(self, sparse_features: KeyedJaggedTensor, sample: DrawnSample, loss_sample: DrawnSample,
                 index_items: Tensor, users: Tensor) -> None:
        self.sparse_features, self.sample, self.loss_sample = sparse_features, sample, loss_sample
        self.index_items, self.users = index_items, users

    def _tensors(self) -> list[Tensor]:
        return [self.sample.ids, self.loss_sample.ids, self.index_items, self.users]

    def to(self, device: torch.device, non_blocking: bool = False) -> SampledBatch:
        ids, loss_ids, found, users = (t.to(device, non_blocking=non_blocking) for t in self._tensors())
        return SampledBatch(self.sparse_features.to(device, non_blocking=non_blocking),
                            DrawnSample(ids, self.sample.sampler, self.sample.batch_items),
                            DrawnSample(loss_ids, self.loss_sample.sampler, self.loss_sample.batch_items),
                            found, users)


class SampledObjective(nn.Module):
    """``(catalog, batch) -> (loss, (rewards, candidates))``: candidates drawn from the sampled catalog, ranked;
    CA-PG on that catalog resampled (the loss's sample, the candidates as its head)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator, self.loss_fn = torch.Generator().manual_seed(0), CAPGLoss(CANDIDATES)

    def forward(self, catalog: SampledCatalog, batch: SampledBatch) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        candidates = sample_candidates(catalog, CANDIDATES, generator=self.generator)
        chosen, rewards = rank(batch.users, candidates)
        loss = self.loss_fn(catalog.resampled(batch.loss_sample, head_items=candidates), candidates, chosen, rewards)
        return loss, (rewards, candidates)


class OnPolicySampledTask(nn.Module):
    """``forward(batch) -> (loss, outputs)`` on-policy, through the sampled mode with an index head."""

    def __init__(self, retriever: TwoTowerRetriever) -> None:
        super().__init__()
        self.retriever, self.objective = retriever, SampledObjective()

    def forward(self, batch: SampledBatch) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        catalog = self.retriever(batch.sparse_features, sample=batch.sample, index_items=batch.index_items)
        return self.objective(catalog, batch)


def sampled_batch(retriever: TwoTowerRetriever, head: IndexHead, batch: int, g: torch.Generator) -> SampledBatch:
    """B users, two uniform samples and the users' index head (collective: every rank calls alike)."""
    users = torch.randint(0, SAMPLED_SETUP.num_users, (batch,), generator=g)
    features = h.user_batch(users)
    found = head(features)
    sampler = UniformSampler(NEGATIVES)
    samples = [DrawnSample(sampler.draw(SAMPLED_SETUP.num_items, None, generator=g, device=torch.device("cpu")),
                           sampler) for _ in range(2)]
    listed = torch.cat([samples[0].ids, samples[1].ids, found.flatten()]).unique()
    return SampledBatch(retriever.with_catalog(features, items=listed), *samples, found, users)


def logged_batch(retriever: TwoTowerRetriever, batch: int, g: torch.Generator) -> LoggedBatch:
    """B users' logged candidates (distinct), shown items, rewards and propensities, and a uniform sample."""
    users = torch.randint(0, SAMPLED_SETUP.num_users, (batch,), generator=g)
    candidates = torch.rand(batch, SAMPLED_SETUP.num_items, generator=g).argsort(1)[:, :CANDIDATES]
    rewards = torch.rand(batch, SHOWN, generator=g)
    log_propensity = torch.log(torch.rand(batch, SHOWN, generator=g) * 0.5 + 0.5)
    sampler = UniformSampler(NEGATIVES)
    sample = DrawnSample(sampler.draw(SAMPLED_SETUP.num_items, None, generator=g, device=torch.device("cpu")), sampler)
    listed = torch.cat([sample.ids, candidates.flatten()]).unique()
    return LoggedBatch(retriever.with_catalog(h.user_batch(users), items=listed), sample, candidates,
                       candidates[:, :SHOWN], rewards, log_propensity)


def rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if a.numel() else 0.0


def local_pieces(model: nn.Module) -> dict[str, Tensor]:
    """Every state entry of ``model`` as this rank's local tensor (its shards, concatenated)."""
    pieces = {}
    for key, value in model.state_dict().items():
        shards = value.local_shards() if hasattr(value, "local_shards") else None
        pieces[key] = (torch.cat([s.tensor.flatten() for s in shards]) if shards is not None else value.flatten()).cpu()
    return pieces


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="users per rank and step")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sampled", action="store_true", help="from logs, through the sampled mode")
    mode.add_argument("--index-head", action="store_true", help="on-policy, the sampled mode with an index head")
    parser.add_argument("--head-in-loader", action="store_true",  # with --index-head
                        help="with --index-head: each run finds the heads as it is fed (see the module docstring)")
    args = parser.parse_args()
    setup, task, names = ((SAMPLED_SETUP, SampledTask, ("loss", "candidates")) if args.sampled
                          else (SAMPLED_SETUP, OnPolicySampledTask, ("rewards", "candidates")) if args.index_head
                          else (SETUP, Task, ("rewards", "candidates")))
    rank, world = h.init()
    state = h.full_state(setup, seed=4, grid=False)
    runs = {}
    for name in ("loop", "pipeline"):
        model = h.shard(setup, lr=LR, wrap=task)
        h.load(model.module.retriever, state)
        optimizer = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                          lambda params: torch.optim.SGD(params, lr=LR))
        runs[name] = (model, optimizer)
    initial = {k: v.clone() for k, v in local_pieces(runs["loop"][0]).items()}
    if args.head_in_loader:
        return _head_in_loader(runs, initial, args)
    retriever = runs["loop"][0].module.retriever
    g = torch.Generator().manual_seed(100 + rank)
    head = IndexHead(retriever, INDEX_HEAD, refresh_every=2)
    batches = []
    for _ in range(args.steps):
        if args.sampled:
            batches.append(logged_batch(retriever, args.batch, g))
            continue
        if args.index_head:  # found before training, from the initial weights: both runs get the same batches
            batches.append(sampled_batch(retriever, head, args.batch, g))
            continue
        users = torch.randint(0, SETUP.num_users, (args.batch,), generator=g)
        batches.append(Batch(dense_features=torch.zeros(args.batch, 0), labels=users,
                             sparse_features=retriever.with_catalog(h.user_batch(users))))
    loop = [_step(*runs["loop"], batch) for batch in batches]
    pipelined, modules = _pipelined(runs["pipeline"], iter(batches), len(batches))
    return _report(runs, initial, {"loop": loop, "pipeline": pipelined}, modules, names, args)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: object) -> tuple[Tensor, Tensor]:
    """One step of the plain loop → the task's first output and candidates."""
    optimizer.zero_grad()
    loss, (first, candidates) = model(batch.to(h.device(), non_blocking=False))
    loss.backward()
    optimizer.step()
    return first, candidates


def _pipelined(run: tuple[nn.Module, torch.optim.Optimizer], batches: Iterator, steps: int) -> tuple[list, list[str]]:
    """``steps`` steps of ``run`` through ``TrainPipelineSparseDist`` fed by ``batches`` → their outputs and the
    modules the pipeline pipelined."""
    model, optimizer = run
    pipeline = TrainPipelineSparseDist(model, optimizer, h.device())
    outputs = [pipeline.progress(batches) for _ in range(steps)]
    return outputs, [type(m).__name__ for m in pipeline._pipelined_modules]


def _head_in_loader(runs: dict, initial: dict[str, Tensor], args: argparse.Namespace) -> int:
    """``--head-in-loader``: each run's batches made as it is fed, their heads from its own retriever's weights
    (a regression: under the pipeline the head's lookups raised TorchRec's 'Invalid PipelinedForward usage')."""
    rank = torch.distributed.get_rank()

    def feed(retriever: TwoTowerRetriever):  # the same users and samples for both runs, heads of their own weights
        g = torch.Generator().manual_seed(100 + rank)
        head = IndexHead(retriever, INDEX_HEAD, refresh_every=2)
        for _ in range(args.steps):
            yield sampled_batch(retriever, head, args.batch, g)

    loop = []
    fed = feed(runs["loop"][0].module.retriever)
    ahead = [next(fed), next(fed)]  # batches 0 and 1, from the initial weights, as the pipeline fills itself
    for _ in range(args.steps):
        following = next(fed, None)  # batch t + 2, before step t (the pipeline's order)
        if following is not None:
            ahead.append(following)
        loop.append(_step(*runs["loop"], ahead.pop(0)))
    pipelined, modules = _pipelined(runs["pipeline"], feed(runs["pipeline"][0].module.retriever), args.steps)
    return _report(runs, initial, {"loop": loop, "pipeline": pipelined}, modules, ("rewards", "candidates"), args)


def _report(runs: dict, initial: dict[str, Tensor], outputs: dict[str, list], pipelined: list[str],
            names: tuple[str, str], args: argparse.Namespace) -> int:
    """The plain loop's and the pipeline's steps and final shards compared, written to ``--out``; 0 if they agree."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    errors: dict[str, float] = {}
    for t, (ref, got) in enumerate(zip(outputs["loop"], outputs["pipeline"])):
        errors[f"step{t}/{names[0]}"] = rel(got[0], ref[0])
        errors[f"step{t}/{names[1]}"] = 0.0 if torch.equal(got[1].cpu(), ref[1].cpu()) else float("inf")
    loop_state, pipe_state = local_pieces(runs["loop"][0]), local_pieces(runs["pipeline"][0])
    for key, value in loop_state.items():
        errors[f"final/{key}"] = rel(pipe_state[key], value)
        # the comparison proves something only if training moved the parameter
        errors[f"moved/{key}"] = 0.0 if not torch.equal(value, initial[key]) else float("inf")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pipeline_rank{rank}.json").write_text(json.dumps(
        {"world_size": world, "pipelined_modules": pipelined, "errors": errors}, indent=1))
    h.teardown(*(m for m, _ in runs.values()))
    return 0 if max(errors.values()) <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
