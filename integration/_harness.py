"""Shared set-up for the multi-rank scenarios (run under torchrun: gloo on CPU, or NCCL on GPUs).

A scenario builds the same two-tower retriever twice: sharded over the ranks with
``DistributedModelParallel`` (fused SGD applied in backward) and unsharded in this process (the
single-process reference, fed the whole global batch). Both start from the same full tables.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torch.distributed._shard.sharded_tensor import ShardedTensor

from capg_rec.torchrec import TwoTowerRetriever

ITEM_TABLE, USER_TABLE = "item_table", "user_table"
CATALOG, USER_ID = "catalog", "user_id"


@dataclass(frozen=True)
class Setup:
    """A retriever configuration: catalog size, experts, dims, sharding of the item table."""
    num_items: int
    num_experts: int
    dim: int
    num_users: int = 64
    temperature: float = 1.0
    sharding: str = "row_wise"
    tower: bool = False
    chunk_size: int = 1024

    @property
    def width(self) -> int:
        return self.num_experts * self.dim


def backend() -> str:
    """``CAPG_BACKEND`` if set, else NCCL when CUDA is present and gloo otherwise."""
    return os.environ.get("CAPG_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", env_int("LOCAL_RANK", 0)) if backend() == "nccl" else torch.device("cpu")


def init() -> tuple[int, int]:
    """Start the process group (:func:`backend`); (rank, world size). A collective that waits longer
    than ``CAPG_COLLECTIVE_TIMEOUT_S`` seconds (default 300) fails instead of hanging."""
    torch.set_num_threads(1)
    if backend() == "nccl":
        torch.cuda.set_device(device())
    dist.init_process_group(backend(), timeout=timedelta(seconds=env_int("CAPG_COLLECTIVE_TIMEOUT_S", 300)))
    return dist.get_rank(), dist.get_world_size()


def teardown(*models: nn.Module) -> None:
    """Barrier, drop the models, destroy the group: ranks then exit cleanly."""
    dist.barrier()
    del models
    gc.collect()
    dist.destroy_process_group()


def build(setup: Setup, device: str = "cpu") -> TwoTowerRetriever:
    tables = [EmbeddingConfig(name=ITEM_TABLE, embedding_dim=setup.width, num_embeddings=setup.num_items,
                              feature_names=[CATALOG]),
              EmbeddingConfig(name=USER_TABLE, embedding_dim=setup.width, num_embeddings=setup.num_users,
                              feature_names=[USER_ID])]
    tower = None
    if setup.tower:
        tower = nn.Sequential(nn.Linear(setup.width, 32), nn.ReLU(), nn.Linear(32, setup.width)).to(device)
    return TwoTowerRetriever(EmbeddingCollection(tables=tables, device=torch.device(device)),
                             item_table=ITEM_TABLE, num_experts=setup.num_experts,
                             temperature=setup.temperature, user_features=[USER_ID], user_tower=tower,
                             catalog_feature=CATALOG, chunk_size=setup.chunk_size)


def shard(setup: Setup, lr: float, user_sharding: str | None = None,
          wrap: Callable[[TwoTowerRetriever], nn.Module] | None = None) -> DistributedModelParallel:
    """The retriever on meta (inside ``wrap(retriever)`` if given), fused SGD(lr) in backward, sharded
    with the item table ``setup.sharding``, on :func:`device`."""
    retriever = build(setup, device="meta")
    _apply_optimizer_in_backward(torch.optim.SGD, retriever.embeddings.parameters(), {"lr": lr})
    model = retriever if wrap is None else wrap(retriever)
    kernel = "dense" if setup.sharding == "data_parallel" else "fused"
    constraints = {ITEM_TABLE: ParameterConstraints(sharding_types=[setup.sharding], compute_kernels=[kernel]),
                   USER_TABLE: ParameterConstraints(sharding_types=[user_sharding or "row_wise"],
                                                    compute_kernels=["fused"])}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=dist.get_world_size(),
                                                         compute_device=device().type), constraints=constraints)
    sharders = [EmbeddingCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    # The retriever returns a catalog object, not tensors: DDP's static-graph mode (TorchRec's
    # default) would then miss its first-iteration gradient sync, so use the dynamic mode.
    return DistributedModelParallel(model, device=device(), plan=plan, sharders=sharders,
                                    data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False))


def full_state(setup: Setup, seed: int, *, grid: bool = True) -> dict[str, Tensor]:
    """Full tables (and tower) for ``setup``, the same on every rank.

    ``grid=True`` puts the embeddings on multiples of 2^-10 in [-1, 1]: with ``M·D ≤ 16`` and a
    power-of-two temperature every score is then exact in float32, whatever the summation order,
    so sampled candidates can be compared exactly (and ties stay rare).
    """
    g = torch.Generator().manual_seed(seed)
    state = build(setup).state_dict()
    out = {}
    for key, value in state.items():
        if grid and value.dim() == 2 and value.shape[1] == setup.width and "embeddings" in key:
            out[key] = torch.randint(-1024, 1025, value.shape, generator=g).float() / 1024
        else:
            out[key] = torch.randn(value.shape, generator=g) * 0.3
    return out


def load(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy full tensors into a (possibly sharded) model: each rank writes its own shards."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(state[key][r: r + nr, c: c + nc])
            else:
                value.copy_(state[key])


def max_shard_error(model: nn.Module, reference: nn.Module,
                    base: dict[str, Tensor] | None = None) -> dict[str, float]:
    """Largest |sharded - reference| / max|reference| of each tensor, over this rank's shards.

    With ``base`` (full tensors on the CPU) the updates ``model - base`` and ``reference - base`` are
    compared. Everything is compared on the CPU.
    """
    ref = {k: v.cpu() for k, v in reference.state_dict().items()}
    errors = {}
    for key, value in model.state_dict().items():
        full_ref = ref[key] - base[key] if base is not None else ref[key]
        pieces = []
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                local = shard.tensor.cpu()
                mine = local - base[key][r: r + nr, c: c + nc] if base is not None else local
                pieces.append((mine, full_ref[r: r + nr, c: c + nc]))
        else:
            value = value.cpu()
            pieces.append((value - base[key] if base is not None else value, full_ref))
        scale = float(full_ref.abs().max())
        if scale == 0.0 and base is not None:  # an update that never happened proves nothing
            errors[key] = float("inf")
            continue
        errors[key] = max((float((a - b).abs().max()) for a, b in pieces if a.numel()), default=0.0) / (scale or 1.0)
    return errors


def user_batch(users: Tensor) -> KeyedJaggedTensor:
    """A KJT of one ``user_id`` per user, on the users' device."""
    return KeyedJaggedTensor.from_lengths_sync([USER_ID], users, torch.ones_like(users))


def my_slice(batch: int, rank: int, world: int) -> slice:
    """Rows of a global batch of ``batch`` that rank ``rank`` holds (equal blocks)."""
    if batch % world:
        raise ValueError(f"the global batch {batch} must split evenly over {world} ranks")
    per = batch // world
    return slice(rank * per, (rank + 1) * per)


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


