"""A two-tower early-stage retriever on TorchRec modules whose forward returns catalog scores."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from capg_rec._checks import check_count, check_positive
from capg_rec.torchrec.catalog import ShardedEmbeddingCatalog

__all__ = ["TwoTowerRetriever"]

_SHARDABLE = (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value)


class TwoTowerRetriever(nn.Module):
    """User tower × item table, scored against the whole catalog, for one process or many.

    ``embeddings`` is a TorchRec :class:`EmbeddingCollection` holding the item table
    (``[N, M·D]``: the M experts' rows of an item side by side, so one lookup serves all experts)
    and any user tables. Each user feature is mean-pooled to ``[B, M·D]``; the user vector is
    ``user_tower(cat(pooled features, dense))`` or, without a tower, the sum of the pooled
    features. Scores are ``s[b, m, n] = <user[b, m], item[n, m]> / τ``.

    The item rows reach the scores through TorchRec's lookup: the batch carries a catalog
    feature listing this rank's rows (:meth:`with_catalog` adds it), so gradients go through the
    public path into the fused optimizer, in the same single lookup as the user features.
    Unsharded, the catalog feature lists all N rows; after ``DistributedModelParallel`` (row-wise
    or table-wise item table), it lists the local shard and the returned catalog combines the
    ranks with collectives over a copy of ``process_group`` (default: the world; the sharding
    plan's ranks are ranks of this group), created at the first sharded forward.

    Args:
        embeddings: the collection (unsharded; shard the retriever afterwards if you like).
        item_table: name of the item table.
        num_experts: M; the item table's width must be a multiple of it.
        temperature: τ > 0.
        user_features: features of ``embeddings`` that make the user input.
        user_tower: module mapping ``[B, F·M·D + dense]`` to ``[B, M·D]``, or None.
        catalog_feature: a feature of the item table, reserved for the catalog rows
            (default: the item table's first feature).
        chunk_size: items scored at once in the catalog-wide reductions.
    """

    def __init__(self, embeddings: EmbeddingCollection, *, item_table: str, num_experts: int = 1,
                 temperature: float = 1.0, user_features: Sequence[str] = (),
                 user_tower: nn.Module | None = None, catalog_feature: str | None = None,
                 chunk_size: int = 8192, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not isinstance(embeddings, EmbeddingCollection):
            raise ValueError(f"embeddings must be a torchrec EmbeddingCollection, got {type(embeddings).__name__}")
        configs = {c.name: c for c in embeddings.embedding_configs()}
        if item_table not in configs:
            raise ValueError(f"item_table must name a table of embeddings {sorted(configs)}, got {item_table!r}")
        table = configs[item_table]
        self.num_experts = check_count("num_experts", num_experts)
        if table.embedding_dim % num_experts:
            raise ValueError(f"the item table width must be num_experts·D: {table.embedding_dim} is not a "
                             f"multiple of num_experts={num_experts}")
        self.catalog_feature = catalog_feature if catalog_feature is not None else table.feature_names[0]
        if self.catalog_feature not in table.feature_names:
            raise ValueError(f"catalog_feature must be a feature of table {item_table!r} "
                             f"{table.feature_names}, got {self.catalog_feature!r}")
        features = {f for c in configs.values() for f in c.feature_names}
        self.user_features = list(user_features)
        bad = [f for f in self.user_features if f not in features or f == self.catalog_feature]
        if bad:
            raise ValueError(f"user_features must be features of embeddings other than the catalog feature "
                             f"{self.catalog_feature!r}, got {bad}")
        if user_tower is None and not self.user_features:
            raise ValueError("give user_features, a user_tower, or both")
        self.embeddings = embeddings
        self.user_tower = user_tower
        self.item_table = item_table
        self.num_items = table.num_embeddings
        self.width = table.embedding_dim
        self.temperature = check_positive("temperature", temperature)
        self.chunk_size = check_count("chunk_size", chunk_size)
        self.process_group = process_group
        self._catalog_group: dist.ProcessGroup | None = None

    def _layout(self) -> tuple[int, int, dist.ProcessGroup | None]:
        """(first global row, number of rows, process group) of this rank's item rows."""
        if isinstance(self.embeddings, EmbeddingCollection):
            return 0, self.num_items, None
        if not isinstance(self.embeddings, ShardedEmbeddingCollection):
            raise ValueError(f"embeddings must be an EmbeddingCollection or its sharded form, "
                             f"got {type(self.embeddings).__name__}")
        sharding = self.embeddings.module_sharding_plan[self.item_table]
        if sharding.sharding_type not in _SHARDABLE:
            raise ValueError(f"the item table {self.item_table!r} must be sharded {' or '.join(_SHARDABLE)} "
                             f"(each rank holding whole rows), got {sharding.sharding_type}")
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if self._catalog_group is None:
            # The catalog's collectives get their own group: in backward they then cannot interleave
            # differently across ranks with TorchRec's all-to-alls (table-wise shards give the ranks
            # different graphs, hence different orders).
            self._catalog_group = dist.new_group(ranks=dist.get_process_group_ranks(group))
        rank = dist.get_rank(group)
        for shard in sharding.sharding_spec.shards:
            if shard.placement.rank() == rank:
                return shard.shard_offsets[0], shard.shard_sizes[0], self._catalog_group
        return 0, 0, self._catalog_group

    def catalog_ids(self) -> Tensor:
        """Global ids of this rank's item rows ``[R]``: the values of the catalog feature."""
        offset, rows, _ = self._layout()
        return torch.arange(offset, offset + rows)

    def with_catalog(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` plus the catalog feature (this rank's rows, all attached to the first sample)."""
        ids = self.catalog_ids().to(features.values().device)
        lengths = torch.zeros(features.stride(), dtype=features.lengths().dtype, device=ids.device)
        lengths[0] = ids.numel()
        catalog = KeyedJaggedTensor.from_lengths_sync([self.catalog_feature], ids, lengths)
        return KeyedJaggedTensor.concat([features, catalog])

    def forward(self, features: KeyedJaggedTensor, dense: Tensor | None = None) -> ShardedEmbeddingCatalog:
        """Catalog scores for the users of ``features`` (which must carry the catalog feature).

        ``dense [B, F]`` goes to the user tower next to the pooled user features.
        """
        offset, rows, group = self._layout()
        if self.catalog_feature not in features.keys():
            raise ValueError(f"features has no catalog feature {self.catalog_feature!r} (keys {features.keys()}): "
                             f"add this rank's item rows with retriever.with_catalog(features)")
        ids = features[self.catalog_feature].values()
        expected = torch.arange(offset, offset + rows, device=ids.device)
        if ids.shape != expected.shape or not torch.equal(ids.long(), expected):
            raise ValueError(f"the catalog feature {self.catalog_feature!r} must list this rank's item rows "
                             f"[{offset}, {offset + rows}) in order, got {ids.numel()} ids: "
                             f"build it with retriever.with_catalog(features)")
        if dense is not None and self.user_tower is None:
            raise ValueError("dense features need a user_tower")
        out = self.embeddings(features)
        pooled = [_mean_pool(out[f].values(), out[f].lengths(), features.stride()) for f in self.user_features]
        if self.user_tower is None:
            user = torch.stack(pooled).sum(0)
        else:
            user = self.user_tower(torch.cat(pooled + ([dense] if dense is not None else []), dim=1))
        if user.dim() != 2 or user.shape[1] != self.width:
            raise ValueError(f"the user side must give [B, num_experts·D = {self.width}] to match the item table, "
                             f"got {tuple(user.shape)}")
        dim = self.width // self.num_experts
        item = out[self.catalog_feature].values().view(rows, self.num_experts, dim)
        return ShardedEmbeddingCatalog(user.view(-1, self.num_experts, dim), item, num_items=self.num_items,
                                       row_offset=offset, temperature=self.temperature,
                                       chunk_size=self.chunk_size, process_group=group)


def _mean_pool(values: Tensor, lengths: Tensor, batch_size: int) -> Tensor:
    """Mean of each sample's rows: ``values [Σ lengths, W]``, ``lengths [B]`` → ``[B, W]`` (0 if empty)."""
    owner = torch.repeat_interleave(torch.arange(batch_size, device=values.device), lengths)
    total = values.new_zeros((batch_size, values.shape[1])).index_add(0, owner, values)
    return total / lengths.clamp(min=1).unsqueeze(1).to(values.dtype)
