"""A two-tower early-stage retriever on TorchRec modules whose forward returns catalog scores."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.utils.checkpoint import checkpoint
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from capg_rec._checks import check_count, check_flag, check_id_tensor, check_items, check_positive, \
    check_same_device, is_id_tensor, resolve_validate_args
from capg_rec.ann import ItemIndex
from capg_rec.marginals import DEFAULT_METHOD, InclusionMethod
from capg_rec.catalog import check_exclude, unpadded
from capg_rec.sampled import DrawnSample, SampledCatalog, check_index_items
from capg_rec.serving import ServingRetriever
from capg_rec._collective import agree, all_gather_rows, exchange, least, on_ranks, ranks_where, \
    stack_ranks
from capg_rec.torchrec.catalog import ShardedEmbeddingCatalog

__all__ = ["TwoTowerRetriever"]

_SHARDABLE = (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value)


class TwoTowerRetriever(nn.Module):
    """User tower × item table, scored against the whole catalog, for one process or many.

    ``embeddings`` is a TorchRec :class:`EmbeddingCollection` holding the item table and any
    user tables; ``user_embeddings``, an optional :class:`EmbeddingBagCollection`, holds pooled user
    features (its own KJT, ``bag_features``). The item vectors are ``item_tower(rows)`` or, without
    a tower, the rows themselves: ``[N, M·D]``, the M experts' vectors of an item side by side, so
    one lookup serves all experts. Each user feature of the collection is mean-pooled, each of the
    bag collection pooled by its own rule; the user vector is ``user_tower(cat(pooled features,
    dense))`` or, without a tower, the sum of the pooled features. Scores are
    ``s[b, m, n] = <user[b, m], item[n, m]> / τ``.

    The item tower runs on this rank's rows in chunks of ``chunk_size`` (8,192 if None) under activation
    checkpointing: its activations are recomputed in backward, so its memory is bounded by a chunk
    (plus the ``[R, M·D]`` item vectors). Its parameters are replicated like the user tower's (DDP
    averages their gradients, which matches one process over the global batch).

    The item rows reach the scores through TorchRec's lookup: the batch carries a catalog
    feature listing this rank's rows in an extra last sample (:meth:`with_catalog` adds it), so
    a batch of B users is a KJT of stride B + 1 and gradients go through the
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
        user_features: features of ``embeddings`` or ``user_embeddings`` that make the user input.
        user_tower: module mapping ``[B, Σ feature widths + dense]`` to ``[B, M·D]``, or None.
        user_embeddings: an :class:`EmbeddingBagCollection` of pooled user features, or None.
        item_tower: module mapping item rows ``[R, table width]`` to ``[R, M·D]`` (row by row: the
            same on any chunking), or None.
        catalog_feature: a feature of the item table, reserved for the catalog rows
            (default: the item table's first feature).
        chunk_size: items scored at once in the catalog-wide reductions (None: the catalog's default,
            :func:`capg_rec.catalog.chunk_items`), and item rows run through the item tower at once (None: 8,192).
        process_group: the ranks the item table is sharded over (default: the world).
        validate_args: check the inputs' values (the catalog feature, and the catalog's checks);
            ``None`` takes :func:`capg_rec.set_default_validate_args`'s default at each forward.

    Shape:
        - forward: ``features`` of B users (a KJT of stride B + 1: :meth:`with_catalog`), ``dense [B, F]``,
          ``masked_items [B, E]`` → a :class:`ShardedEmbeddingCatalog` of scores ``[B, M, N]`` (this rank's users;
          with ``sample``, a :class:`~capg_rec.SampledCatalog`)
        - :meth:`user_vectors` → ``[B, M, D]``; :meth:`item_vectors` → ``[N, M, D]``

    Example:
        >>> from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
        >>> tables = [EmbeddingConfig(name="item_table", embedding_dim=8, num_embeddings=100, feature_names=["item"]),
        ...           EmbeddingConfig(name="user_table", embedding_dim=8, num_embeddings=10, feature_names=["user_id"])]
        >>> retriever = TwoTowerRetriever(EmbeddingCollection(tables=tables), item_table="item_table", num_experts=2,
        ...                               user_features=["user_id"])            # unsharded: one process
        >>> users = KeyedJaggedTensor.from_lengths_sync(["user_id"], torch.tensor([0, 3, 7]), torch.tensor([1, 1, 1]))
        >>> seen = torch.tensor([[5, -1], [6, 7], [-1, -1]])                   # masked_items [B, E], -1 pads
        >>> catalog = retriever(retriever.with_catalog(users), masked_items=seen)
        >>> capg_rec.sample_candidates(catalog, 10).shape, retriever.item_vectors().shape
        (torch.Size([3, 10]), torch.Size([100, 2, 4]))
    """

    def __init__(self, embeddings: EmbeddingCollection, *, item_table: str, num_experts: int = 1,
                 temperature: float = 1.0, user_features: Sequence[str] = (),
                 user_tower: nn.Module | None = None, catalog_feature: str | None = None,
                 chunk_size: int | None = None, process_group: dist.ProcessGroup | None = None,
                 validate_args: bool | None = None, user_embeddings: EmbeddingBagCollection | None = None,
                 item_tower: nn.Module | None = None) -> None:
        super().__init__()
        if isinstance(embeddings, EmbeddingBagCollection):
            raise TypeError("embeddings must be a torchrec EmbeddingCollection holding the item table (its rows are "
                            "looked up one by one); pass an EmbeddingBagCollection of user features as "
                            "user_embeddings")
        if not isinstance(embeddings, EmbeddingCollection):
            raise TypeError(f"embeddings must be a torchrec EmbeddingCollection, got {type(embeddings).__name__}")
        if user_embeddings is not None and not isinstance(user_embeddings, EmbeddingBagCollection):
            raise TypeError(f"user_embeddings must be a torchrec EmbeddingBagCollection, "
                            f"got {type(user_embeddings).__name__}")
        configs = {c.name: c for c in embeddings.embedding_configs()}
        if item_table not in configs:
            raise ValueError(f"item_table must name a table of embeddings {sorted(configs)}, got {item_table!r}")
        table = configs[item_table]
        self.num_experts = check_count("num_experts", num_experts)
        if item_tower is None and table.embedding_dim % num_experts:
            raise ValueError(f"the item table width must be num_experts·D: {table.embedding_dim} is not a "
                             f"multiple of num_experts={num_experts}")
        self.catalog_feature = catalog_feature if catalog_feature is not None else table.feature_names[0]
        if self.catalog_feature not in table.feature_names:
            raise ValueError(f"catalog_feature must be a feature of table {item_table!r} "
                             f"{table.feature_names}, got {self.catalog_feature!r}")
        features = {f for c in configs.values() for f in c.feature_names}
        bags = set() if user_embeddings is None else \
            {f for c in user_embeddings.embedding_bag_configs() for f in c.feature_names}
        if isinstance(user_features, str) or not all(isinstance(f, str) for f in user_features):
            raise TypeError(f"user_features must be a list of feature names, got {user_features!r}")
        self.user_features = list(user_features)
        if len(set(self.user_features)) != len(self.user_features):  # a repeat would count its vector twice
            raise ValueError(f"user_features must name each feature once, got {self.user_features}")
        for name, tower in (("user_tower", user_tower), ("item_tower", item_tower)):
            if tower is not None and not isinstance(tower, nn.Module):
                raise TypeError(f"{name} must be an nn.Module (its parameters are trained), got {type(tower).__name__}")
        bad = [f for f in self.user_features if f not in features | bags or f == self.catalog_feature]
        if bad:
            raise ValueError(f"user_features must be features of embeddings or user_embeddings other than the "
                             f"catalog feature {self.catalog_feature!r}, got {bad}")
        if features & bags:
            raise ValueError(f"embeddings and user_embeddings must not share feature names, "
                             f"got {sorted(features & bags)}")
        self._bag_features = bags
        self._weighted_bags = user_embeddings is not None and user_embeddings.is_weighted()
        # The collection's user features, in the order of user_features, then the others sorted: the order of the
        # lookups made without a user batch (item_vectors), which may be the first ones (see _check_key_order).
        others = features - {self.catalog_feature}
        self._other_features = [f for f in self.user_features if f in others] + \
            sorted(others - set(self.user_features))
        self._feature_rows = {f: c.num_embeddings for c in [*configs.values(), *(
            [] if user_embeddings is None else user_embeddings.embedding_bag_configs())] for f in c.feature_names}
        if user_tower is None and not self.user_features:
            raise ValueError("give user_features, a user_tower, or both")
        self.embeddings = embeddings
        self.user_embeddings = user_embeddings
        if item_tower is not None and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in item_tower.modules()):
            raise ValueError("item_tower must map item rows one by one: batch norm would take its statistics over each "
                             "chunk of rows of each rank (and update them twice a step: the chunks are recomputed in "
                             "backward); use a layer norm")
        self.user_tower = user_tower
        self.item_tower = item_tower
        self.item_table = item_table
        self.num_items = table.num_embeddings
        self.temperature = check_positive("temperature", temperature)
        self.chunk_size = None if chunk_size is None else check_count("chunk_size", chunk_size)
        self.process_group = process_group
        self.validate_args = None if validate_args is None else check_flag("validate_args", validate_args)
        self._catalog_group: dist.ProcessGroup | None = None
        self._scorer = _Scorer(self._scores)
        # the order of the keys of the first KJT each lookup took ("features", "bag_features"), and which call took it:
        # see _check_key_order
        self._key_orders: dict[str, tuple[tuple[str, ...], str]] = {}

    def _layout(self) -> tuple[int, int, dist.ProcessGroup | None]:
        """(first global row, number of rows, process group) of this rank's item rows; the group is made at the
        first call (a collective: every rank makes it)."""
        offset, rows = self._rows()
        if isinstance(self.embeddings, EmbeddingCollection):
            return offset, rows, None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if self._catalog_group is None:
            # The catalog's collectives get their own group: in backward they then cannot interleave
            # differently across ranks with TorchRec's all-to-alls (table-wise shards give the ranks
            # different graphs, hence different orders).
            # ... with the parent group's timeout (new_group's default is the backend's, 30 minutes for
            # gloo): a rank that stops answering then fails the others' collectives as it would the world's
            self._catalog_group = dist.new_group(ranks=dist.get_process_group_ranks(group),
                                                 timeout=_group_timeout(group))
        return offset, rows, self._catalog_group

    def _rows(self) -> tuple[int, int]:
        """(first global row, number of rows) of this rank's item rows, from the sharding plan: no collective."""
        if isinstance(self.embeddings, EmbeddingCollection):
            return 0, self.num_items
        if not isinstance(self.embeddings, ShardedEmbeddingCollection):
            raise TypeError(f"embeddings must be an EmbeddingCollection or its sharded form, "
                             f"got {type(self.embeddings).__name__}")
        sharding = self.embeddings.module_sharding_plan[self.item_table]
        if sharding.sharding_type not in _SHARDABLE:
            raise ValueError(f"the item table {self.item_table!r} must be sharded {' or '.join(_SHARDABLE)} "
                             f"(each rank holding whole rows), got {sharding.sharding_type}")
        rank = dist.get_rank(self.process_group if self.process_group is not None else dist.group.WORLD)
        for shard in sharding.sharding_spec.shards:
            if shard.placement.rank() == rank:
                return shard.shard_offsets[0], shard.shard_sizes[0]
        return 0, 0

    def catalog_ids(self) -> Tensor:
        """Global ids of this rank's item rows ``[R]``: the values of the catalog feature (a local call, as
        :meth:`with_catalog`: no collective)."""
        offset, rows = self._rows()
        return torch.arange(offset, offset + rows)

    def with_catalog(self, features: KeyedJaggedTensor, items: Tensor | None = None) -> KeyedJaggedTensor:
        """``features`` of B users plus one sample appended after them whose only feature is the
        catalog feature, listing this rank's rows: a KJT of stride ``B + 1`` (also for B = 0, which
        TorchRec's sharded lookup cannot take as stride 0). ``features`` must not have the catalog feature.

        With ``items`` (global ids ``[S']``: a negative sample and the batch's named items) the last sample
        lists those instead, looked up wherever their rows live: :meth:`forward` with ``sample`` then
        scores against them (a sampled catalog, whose cost does not grow with the catalog). Their ``-1``
        entries (a sample's unused slots, an approximate index's padding) are left out."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        if self.catalog_feature in features.keys():
            raise ValueError(f"features already has the catalog feature {self.catalog_feature!r}: call "
                             f"with_catalog once per batch, on features without it")
        _check_jagged("features", features, resolve_validate_args(self.validate_args))  # one stride for every key
        if items is not None and (not isinstance(items, Tensor) or items.dim() != 1 or items.is_floating_point()
                                  or items.dtype == torch.bool):
            raise TypeError(f"items must be a 1-d tensor of item ids [S'], got "
                            f"{getattr(items, 'shape', type(items).__name__)}")
        ids = (self.catalog_ids() if items is None else items[items != -1]).to(features.values().device)
        batch, keys = features.stride(), features.keys()
        # int64 lengths and values whatever the caller's (an empty batch's are often int32): TorchRec's all-to-all
        # of the lookup takes each rank's buffers as they are, and ranks of two dtypes aborted the job inside gloo
        lengths = features.lengths().long().view(len(keys), batch)
        lengths = torch.cat([torch.nn.functional.pad(lengths, (0, 1)).flatten(),
                             torch.nn.functional.pad(lengths.new_full((1,), ids.numel()), (batch, 0))])
        weights = features.weights_or_none()
        if weights is not None:
            weights = torch.cat([weights, weights.new_ones(ids.numel())])
        return KeyedJaggedTensor(keys=[*keys, self.catalog_feature], values=torch.cat([features.values().long(),
                                 ids.long()]), weights=weights, lengths=lengths, stride=batch + 1)

    def forward(self, features: KeyedJaggedTensor, dense: Tensor | None = None, *,
                masked_items: Tensor | None = None, bag_features: KeyedJaggedTensor | None = None,
                sample: DrawnSample | None = None, head_items: Tensor | None = None,
                index_items: Tensor | None = None) -> ShardedEmbeddingCatalog | SampledCatalog:
        """Catalog scores for the B users of ``features`` (built by :meth:`with_catalog`: stride B + 1).

        ``dense [B, F]`` goes to the user tower next to the pooled user features. ``masked_items
        [B, E]`` (global ids, ``-1`` pads) are the items outside each user's catalog: see
        :class:`ShardedEmbeddingCatalog`. ``bag_features``: the KJT of ``user_embeddings`` (stride B,
        or B + 1 with an empty last sample: a rank without users passes stride 1). With several
        ranks, a mistake in the inputs of one rank is raised on every rank when validating.

        With ``sample`` (a :class:`~capg_rec.DrawnSample` of negatives) the result is instead a
        :class:`~capg_rec.SampledCatalog` for this rank's users alone: catalog-wide sums estimated from
        the sample, ``head_items [B, H]`` (``-1`` pads: the candidates, logged items) and ``index_items
        [B, M, H']`` (each expert's best H' items in a nearest-neighbour index, found before the lookup:
        :class:`~capg_rec.torchrec.IndexHead`) scored exactly. ``features`` must then list the sample's and
        the head's ids (:meth:`with_catalog` with ``items``); any item the losses name (candidates, shown
        items) must be among them. Each rank's
        cost is that of its sample and head, whatever the catalog's size; the only communication is
        TorchRec's lookup, and the item rows' gradients go through it as usual.

        ``TrainPipelineSparseDist`` traces this forward with torch.fx: what it sees is the lookups of
        ``features`` (and ``bag_features``) and one call of a leaf module that builds the catalog (the
        checks run in the eager calls only, before the lookups).
        """
        offset, rows, group = self._layout()
        if not is_fx_symbolic_tracing():
            self._check_collectively(features, dense, bag_features, offset, rows, group, sample, head_items,
                                     index_items, masked_items)
        bags = None if self.user_embeddings is None else self.user_embeddings(bag_features)
        out = self.embeddings(features)
        self._record_key_orders(features, bag_features)
        return self._scorer(features, out, bags, dense, masked_items, sample, head_items, index_items)

    def _check_collectively(self, features: KeyedJaggedTensor, dense: Tensor | None,
                            bag_features: KeyedJaggedTensor | None, offset: int, rows: int,
                            group: dist.ProcessGroup | None, sample: DrawnSample | None,
                            head_items: Tensor | None, index_items: Tensor | None, masked_items: Tensor | None) -> None:
        """:meth:`_check_inputs` on every rank; one rank's error is raised on all (when validating)."""
        validate = resolve_validate_args(self.validate_args)

        def check() -> list[int]:
            self._check_inputs(features, dense, bag_features, offset, rows, validate, sample, head_items, index_items)
            if sample is not None and masked_items is not None:  # the sampled catalog is built unchecked
                check_items("masked_items", masked_items, batch_size=features.stride() - 1, num_items=self.num_items,
                            unique=False, validate=validate, low=-1, columns="E")
            # sampled or not, and the heads' widths: the sampled catalogs' lookups are collective when validating;
            # dense's width: the user tower runs on every rank alike
            return [-2 if sample is None else -1 if head_items is None else head_items.shape[1],
                    -1 if index_items is None else index_items.shape[-1], -1 if dense is None else dense.shape[1],
                    *_layout(features), *_layout(bag_features)]

        if group is not None and validate:
            device = features.values().device if isinstance(features, KeyedJaggedTensor) else torch.device("cpu")
            shapes = [tuple(entries) for entries in exchange(check, 3 + 2 * _LAYOUT_SIZE, group, device)]
            if len({entries[:3] for entries in shapes}) > 1:
                raise ValueError(f"sample, head_items, index_items and dense must be given on every rank or none, "
                                 f"each of one width, got (sample: -2 if none, else head_items' width or -1; "
                                 f"index_items' width or -1; dense's width or -1) {[e[:3] for e in shapes]} by rank")
            _check_layouts([e[3:] for e in shapes])
        else:
            check()

    def _scores(self, features: KeyedJaggedTensor, out: dict[str, JaggedTensor], bags: KeyedTensor | None,
                dense: Tensor | None, masked_items: Tensor | None, sample: DrawnSample | None,
                head_items: Tensor | None, index_items: Tensor | None) -> ShardedEmbeddingCatalog | SampledCatalog:
        """The lookups' outputs ``out`` and ``bags`` → the catalog (see :class:`_Scorer`)."""
        offset, rows, group = self._layout()
        user = self._user(out, bags, dense, features.stride() - 1)
        item = self._item(out)
        width = item.shape[1]
        if item.dim() != 2 or width % self.num_experts:
            raise ValueError(f"the item side must give [R, num_experts·D] (num_experts={self.num_experts}), "
                             f"got {tuple(item.shape)}")
        if user.dim() != 2 or user.shape[1] != width:
            raise ValueError(f"the user side must give [B, num_experts·D = {width}] to match the item side, "
                             f"got {tuple(user.shape)}")
        dim = width // self.num_experts
        if sample is not None:
            listed = features[self.catalog_feature].values().long()
            tower = _ListedRows(listed, item.view(-1, self.num_experts, dim), group,
                                resolve_validate_args(self.validate_args))
            with tower.trusting():  # the forward checked that the sample and heads were listed
                return _RankSampledCatalog(user.view(-1, self.num_experts, dim), tower, num_items=self.num_items,
                                           sampler=sample, temperature=self.temperature, head_items=head_items,
                                           index_items=index_items, masked_items=masked_items,
                                           validate_args=False,  # values checked collectively
                                           group=group, check_draws=tower.validate)
        item = item.view(rows, self.num_experts, dim)
        return ShardedEmbeddingCatalog(user.view(-1, self.num_experts, dim), item, num_items=self.num_items,
                                       row_offset=offset, temperature=self.temperature, masked_items=masked_items,
                                       chunk_size=self.chunk_size, process_group=group,
                                       validate_args=self.validate_args)

    def _user(self, out: dict[str, JaggedTensor], bags: KeyedTensor | None, dense: Tensor | None,
              batch: int) -> Tensor:
        """The user side of the first ``batch`` samples of the lookups → ``[B, M·D]``."""
        pooled = [bags[f][:batch] if f in self._bag_features else _mean_pool(out[f].values(), out[f].lengths(), batch)
                  for f in self.user_features]
        if self.user_tower is None:
            if len({p.shape[1] for p in pooled}) > 1:
                raise ValueError(f"without a user_tower the user features must have one width (they are summed), "
                                 f"got {[p.shape[1] for p in pooled]}")
            return torch.stack(pooled).sum(0)
        return self.user_tower(torch.cat(pooled + ([dense] if dense is not None else []), dim=1))

    def _item(self, out: dict[str, JaggedTensor]) -> Tensor:
        """The item side of this rank's rows (the catalog feature's lookup) → ``[R, M·D]``."""
        item = out[self.catalog_feature].values()
        return item if self.item_tower is None else _chunked_tower(self.item_tower, item,
                                                                   self.chunk_size or _TOWER_CHUNK_ROWS)

    def _without_users(self, batch: int, device: torch.device) -> KeyedJaggedTensor:
        """Features of ``batch`` samples with every user feature of ``embeddings`` and no ids, in the order of
        the first batch looked up (:meth:`_check_key_order`)."""
        seen = self._key_orders.get("features")
        keys = self._other_features if seen is None else list(seen[0][:-1])
        none = torch.zeros(0, dtype=torch.long, device=device)
        return KeyedJaggedTensor(keys=keys, values=none, lengths=torch.zeros(len(keys) * batch, dtype=torch.int32,
                                                                             device=device), stride=batch)

    @torch.no_grad()
    def item_vectors(self, device: torch.device | str = "cpu") -> Tensor:
        """Every item through the item side (table rows, then the item tower) → ``[N, M, D]``, on every
        rank: the item half of a serving export. Collective when sharded (call it on every rank)."""
        offset, rows, group = self._layout()
        with _eval_mode(self):  # no dropout; batch norm's running statistics read, not updated
            features = self.with_catalog(self._without_users(0, torch.device(device)))
            item = self._item(_unpipelined(self.embeddings, features))
            self._record_key_orders(features, None, "item_vectors() (serving_export), whose item-only lookup lists "
                                    "the user features of the collection as user_features does, then the others "
                                    "sorted")
        if group is not None:  # every rank's rows, in global id order
            layout = exchange(lambda: [offset, rows], 2, group, item.device)  # [offset, rows] per rank
            item = all_gather_rows(item, [n for _, n in layout], group)
            item = item[torch.cat([torch.arange(o, o + n) for o, n in layout]).argsort().to(item.device)]
        return item.view(self.num_items, self.num_experts, -1)

    @torch.no_grad()
    def user_vectors(self, features: KeyedJaggedTensor, dense: Tensor | None = None, *,
                     bag_features: KeyedJaggedTensor | None = None) -> Tensor:
        """The user side of a batch of B users → ``[B, M, D]`` (``features``: stride B, the user features
        of ``embeddings``, without the catalog feature): the user half of a serving export. Collective
        when ``embeddings`` is sharded (every rank looks up its batch)."""
        kjt = isinstance(features, KeyedJaggedTensor)
        batch = features.stride() if kjt else 0
        validate = resolve_validate_args(self.validate_args)

        def check() -> list[int]:
            if not kjt:
                raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
            if self.catalog_feature in features.keys():
                raise ValueError(f"features must not have the catalog feature {self.catalog_feature!r}: "
                                 "user_vectors looks up users only")
            _check_jagged("features", features, validate)
            keys = [*features.keys(), self.catalog_feature]  # as the lookup below takes them
            self._check_key_order("features", keys)
            self._check_user_features(features, bag_features, batch, validate)
            self._check_dense(dense, batch)
            return [-1 if dense is None else dense.shape[1], *_layout(features, ids_cast=True), *_layout(bag_features)]

        group = self._layout()[2]
        if group is not None and validate:  # one rank's mistake raised on every rank
            device = features.values().device if kjt else torch.device("cpu")
            shapes = [tuple(entries) for entries in exchange(check, 1 + 2 * _LAYOUT_SIZE, group, device)]
            _check_layouts([e[1:] for e in shapes])
            widths = [e[0] for e in shapes]
            if len(set(widths)) > 1:
                raise ValueError(f"dense must be given on every rank or none, of one width, got widths (-1: none) "
                                 f"{widths} by rank")
        else:
            check()
        # one empty sample after the B users (TorchRec's lookup cannot take a stride of 0) and no catalog ids
        lengths = torch.nn.functional.pad(features.lengths().long().view(len(features.keys()), batch), (0, 1)).flatten()
        with_empty_catalog = KeyedJaggedTensor(
            keys=[*features.keys(), self.catalog_feature], values=features.values().long(),
            weights=features.weights_or_none(), lengths=torch.cat([lengths, lengths.new_zeros(batch + 1)]),
            stride=batch + 1)
        with _eval_mode(self):  # no dropout; batch norm's running statistics read, not updated
            bags = None if self.user_embeddings is None else _unpipelined(self.user_embeddings, bag_features)
            user = self._user(_unpipelined(self.embeddings, with_empty_catalog), bags, dense, batch)
            self._record_key_orders(with_empty_catalog, bag_features, "user_vectors()")
        return user.view(batch, self.num_experts, user.shape[1] // self.num_experts)

    def serving_export(self, *, index: ItemIndex | None = None, temperature: float | None = None,
                       epsilon: float = 0.0, method: str | InclusionMethod = DEFAULT_METHOD,
                       device: torch.device | str = "cpu") -> ServingRetriever:
        """This retriever for serving (:class:`capg_rec.serving.ServingRetriever`): the item side, every
        item through the item tower, in ``index`` (default: an exact FAISS index), the user side as
        :meth:`user_vectors`. ``temperature`` defaults to the training one. Collective when sharded."""
        items = self.item_vectors(device)
        return ServingRetriever(self.user_vectors, items, index=index, epsilon=epsilon, method=method,
                                temperature=self.temperature if temperature is None else temperature)

    def _check_inputs(self, features: KeyedJaggedTensor, dense: Tensor | None,
                      bag_features: KeyedJaggedTensor | None, offset: int, rows: int, validate: bool,
                      sample: DrawnSample | None, head_items: Tensor | None, index_items: Tensor | None) -> None:
        """The catalog feature lists this rank's rows in the last sample, or with ``sample`` the sample's and
        the heads' ids (the values only when ``validate``: a host sync); ``dense`` goes with a tower."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        _check_jagged("features", features, validate)
        if self.catalog_feature not in features.keys() or features.stride() < 1:
            raise ValueError(f"features has no catalog feature {self.catalog_feature!r} (keys {features.keys()}): "
                             f"add this rank's item rows with retriever.with_catalog(features)")
        if features.keys()[-1] != self.catalog_feature:
            raise ValueError(f"features must list the catalog feature {self.catalog_feature!r} last, got keys "
                             f"{features.keys()}: build it with retriever.with_catalog(features)")
        self._check_key_order("features", features.keys())
        catalog = features[self.catalog_feature]
        ids, lengths = catalog.values(), catalog.lengths()
        if sample is not None or head_items is not None or index_items is not None:
            self._check_listed(ids, lengths, sample, head_items, index_items, features.stride() - 1, validate)
        elif ids.shape != (rows,) or (validate and not (
                torch.equal(ids.long(), torch.arange(offset, offset + rows, device=ids.device))
                and int(lengths[-1]) == rows)):
            raise ValueError(f"the catalog feature {self.catalog_feature!r} must list this rank's item rows "
                             f"[{offset}, {offset + rows}) in order, in the last sample, got {ids.numel()} ids: "
                             f"build it with retriever.with_catalog(features)")
        self._check_dense(dense, features.stride() - 1)
        self._check_user_features(features, bag_features, features.stride() - 1, validate)

    def _order_matters(self, name: str) -> bool:
        """Whether the lookup of ``name`` ("features", "bag_features") reads keys by position: a sharded one (the
        unsharded collections look each key up by its name)."""
        module = self.embeddings if name == "features" else self.user_embeddings
        return not isinstance(module, (EmbeddingCollection, EmbeddingBagCollection))

    def _check_key_order(self, name: str, keys: Sequence[str]) -> None:
        """TorchRec's sharded lookups take the order of their input's keys from the first batch and read every
        later batch in it: a KJT of the same keys in another order would be looked up under the wrong features,
        silently. So every KJT of ``name`` ("features", "bag_features") must list its keys as the first did, where
        the lookup is sharded."""
        seen = self._key_orders.get(name)
        if seen is not None and tuple(keys) != seen[0]:
            raise ValueError(f"{name} must list its keys in the order of the first lookup, {list(seen[0])}, made by "
                             f"{seen[1]} (TorchRec's sharded lookup reads every later one in that order), got "
                             f"{list(keys)}")

    def _record_key_orders(self, features: KeyedJaggedTensor, bag_features: KeyedJaggedTensor | None,
                           origin: str = "the first batch") -> None:
        """After a lookup made by ``origin``: the key orders that :meth:`_check_key_order` requires from now on (the
        first ones)."""
        if not is_fx_symbolic_tracing():
            for name, kjt in (("features", features), ("bag_features", bag_features)):
                if kjt is not None and self._order_matters(name):
                    self._key_orders.setdefault(name, (tuple(kjt.keys()), origin))

    def _check_dense(self, dense: Tensor | None, batch: int) -> None:
        """``dense [B, F]``, given only with a user tower, in its parameters' dtype."""
        if dense is None:
            return
        if self.user_tower is None:
            raise ValueError("dense features need a user_tower")
        if not isinstance(dense, Tensor) or not dense.is_floating_point():
            raise TypeError(f"dense must be a floating tensor [B, F], got "
                            f"{getattr(dense, 'dtype', type(dense).__name__)}")
        weight = next(self.user_tower.parameters(), None)
        if weight is not None and dense.dtype != weight.dtype:
            raise TypeError(f"dense must have the user tower's dtype {weight.dtype}, got {dense.dtype}")
        if dense.dim() != 2 or dense.shape[0] != batch:
            raise ValueError(f"dense must have shape [B, F] with B = {batch} (the users of features), got "
                             f"{list(dense.shape)}")

    def _check_user_features(self, features: KeyedJaggedTensor, bag_features: KeyedJaggedTensor | None, batch: int,
                             validate: bool) -> None:
        """The user side of B = ``batch`` users: every user feature of ``embeddings`` in ``features``,
        ``bag_features`` exactly with ``user_embeddings`` (all of its features; stride B, or B + 1 with an
        empty last sample, which is dropped), and (values, when ``validate``: host syncs) every id within
        its table."""
        missing = [f for f in self._other_features if f not in features.keys()]
        if missing:
            raise ValueError(f"features must hold every user feature of embeddings: {missing} missing from "
                             f"{features.keys()}")
        if (bag_features is None) != (self.user_embeddings is None):
            raise ValueError("bag_features must be given exactly when the retriever has user_embeddings")
        if bag_features is not None:
            if not isinstance(bag_features, KeyedJaggedTensor):
                raise TypeError(f"bag_features must be a KeyedJaggedTensor, got {type(bag_features).__name__}")
            _check_jagged("bag_features", bag_features, validate)
            missing = sorted(self._bag_features - set(bag_features.keys()))
            if missing:
                raise ValueError(f"bag_features must hold every feature of user_embeddings: {missing} missing from "
                                 f"{bag_features.keys()}")
            self._check_key_order("bag_features", bag_features.keys())
            if self._weighted_bags and bag_features.weights_or_none() is None:
                raise ValueError("bag_features must carry weights: user_embeddings is weighted (is_weighted=True)")
            stride = bag_features.stride()
            if stride not in (batch, batch + 1) or stride < 1:
                need = (f"B = {batch} (or B + 1 with an empty last sample)" if batch else
                        "1 with an empty sample for no users (B = 0: a stride of 0 does not carry its keys' lengths)")
                raise ValueError(f"bag_features must have stride {need}, got {stride}")
            if validate and stride == batch + 1 and int(bag_features.lengths().view(-1, stride)[:, -1].sum()):
                raise ValueError(f"bag_features has stride B + 1 = {stride} but its last sample is not empty: it "
                                 f"would be dropped (B = {batch} users)")
        if validate:
            for name, kjt in (("features", features), ("bag_features", bag_features)):
                for f in [] if kjt is None else kjt.keys():
                    ids, rows = kjt[f].values(), self._feature_rows.get(f)
                    if f != self.catalog_feature and rows is not None and ids.numel() and not (
                            int(ids.min()) >= 0 and int(ids.max()) < rows):
                        raise ValueError(f"{name} feature {f!r} must hold ids in [0, {rows}) (its table's rows), "
                                         f"got ids in [{int(ids.min())}, {int(ids.max())}]")


    def _check_listed(self, ids: Tensor, lengths: Tensor, sample: DrawnSample | None, head_items: Tensor | None,
                      index_items: Tensor | None, batch: int, validate: bool) -> None:
        """Sampled mode: a :class:`DrawnSample`, heads ``[B, H]`` and ``[B, M, H']`` of ids, and (values, when
        ``validate``) the catalog feature's ids in the last sample only, in range, listing every id of the
        sample and heads."""
        if not isinstance(sample, DrawnSample):
            raise TypeError(f"sample must be a DrawnSample (head_items and index_items need one), got "
                            f"{type(sample).__name__}")
        if head_items is not None and not is_id_tensor(head_items):
            raise TypeError(f"head_items must be an integer tensor of item ids, got "
                            f"{getattr(head_items, 'dtype', type(head_items).__name__)}")
        if head_items is not None and (head_items.dim() != 2 or head_items.shape[0] != batch):
            raise ValueError(f"head_items must be an id tensor [B={batch}, H], got {tuple(head_items.shape)}")
        if index_items is not None:
            check_index_items(index_items, batch_size=batch, num_experts=self.num_experts, num_items=self.num_items,
                              validate=validate)
        if not validate:
            return
        listed = ids.long()
        if int(lengths[-1]) != listed.numel() or (listed.numel() and not (
                int(listed.min()) >= 0 and int(listed.max()) < self.num_items)):
            raise ValueError(f"the catalog feature {self.catalog_feature!r} must list item ids in [0, "
                             f"{self.num_items}) in the last sample only: build it with "
                             f"retriever.with_catalog(features, items)")
        problem = sample._size_problem(head_items)
        if problem is not None:
            raise ValueError(problem)
        sample._check_counts(self.num_items, head_items)
        named = {"sample": sample.ids, "head_items": head_items, "index_items": index_items}
        for name, part in named.items():
            if part is None:
                continue
            part = part.to(listed.device).reshape(-1)
            part = part[part >= 0]
            if part.numel() and not bool(torch.isin(part, listed).all()):
                raise ValueError(f"every id of {name} must be listed by the catalog feature: build it with "
                                 f"retriever.with_catalog(features, items) with items holding them")


def _check_jagged(name: str, kjt: KeyedJaggedTensor, validate: bool) -> None:
    """A KJT whose parts agree: one length per key and sample (its lengths' size; no host read) and, when
    ``validate``, as many values (and weights) as the lengths add up to (one host read). TorchRec builds a KJT of
    any lengths and fails later, in a reshape or a lookup, or reads other samples' ids."""
    strides = kjt.stride_per_key()  # a variable-stride KJT's too (whose strides may all be equal)
    if len(set(strides)) > 1:
        raise ValueError(f"{name} must have one stride for every key (variable batch sizes are not supported), got "
                         f"strides {strides}")
    keys, lengths = kjt.keys(), kjt.lengths()
    if lengths.numel() != sum(strides):
        raise ValueError(f"{name} must hold one length per key and sample, {len(keys)} keys × stride "
                         f"{kjt.stride()} = {sum(strides)}, got {lengths.numel()} lengths")
    weights = kjt.weights_or_none()
    if validate and (int(lengths.sum()) != kjt.values().numel()
                     or (weights is not None and weights.numel() != kjt.values().numel())):
        raise ValueError(f"{name} must hold as many values (and weights) as its lengths add up to, "
                         f"{int(lengths.sum())}, got {kjt.values().numel()} values"
                         + ("" if weights is None else f" and {weights.numel()} weights"))


class _RankSampledCatalog(SampledCatalog):
    """A rank's :class:`SampledCatalog` of its own batch, whose checks every rank of ``group`` takes alike."""

    def __init__(self, *args: object, group: dist.ProcessGroup | None, check_draws: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.group, self.check_draws = group, check_draws

    def agree(self, passed: Tensor) -> Tensor:
        return agree(passed, self.group)

    def _stack_batches(self, x: Tensor) -> Tensor:
        return stack_ranks(x, self.group)

    def _least(self, *values: int) -> tuple[int, ...]:
        """The least of each over the ranks (one all-reduce): ``exact_top`` picks the methods' paths, which must be
        every rank's (their collectives differ), and a draw's check needs every rank's room."""
        if self.group is None:
            return values
        return tuple(least(torch.tensor(values, device=self.device), self.group).tolist())

    def _vouch(self, name: str, ids: Tensor) -> tuple[Tensor | bool, str]:
        return self._tower.listed(ids), f"an item of {name} " + _UNLISTED

    def _trusting(self, trust: bool = True) -> contextlib.AbstractContextManager:
        return self._tower.trusting(trust)

    def _exclusions(self, exclude: object) -> Tensor | None:
        return check_exclude(exclude, self.batch_size)  # type and shape only: a rank alone must not raise

    def _named(self, items: Tensor, name: str = "items") -> Tensor:
        # Type, shape and device only: the ids are the tower's to check, alike on every rank (a rank alone must not
        # raise; ids on another device fail here on their rank alone, as the lookup itself would).
        items = check_id_tensor(name, items, batch_size=self.batch_size, allow_empty=True)
        check_same_device(self.device, **{name: items})
        return items

    def resampled(self, sampler: DrawnSample, *, head_items: Tensor | None = None, **kwargs: object) -> SampledCatalog:
        """:meth:`SampledCatalog.resampled` with a :class:`DrawnSample` whose ids the batch listed, as ``head_items``
        must be: this catalog's item side is the rows looked up, no other. When validating, a wrong sampler or
        an unlisted id on one rank is an error on every rank (one exchange)."""
        def check() -> list[int | Tensor | bool]:
            if not isinstance(sampler, DrawnSample):
                return [1, 0]
            named = sampler.ids if head_items is None or not isinstance(head_items, Tensor) else torch.cat(
                [sampler.ids.reshape(-1), head_items.reshape(-1).to(sampler.ids)])
            return [0, not self._tower.listed(unpadded(named))]

        group = self.group if self.check_draws else None
        table = exchange(check, 2, group, self.device) if group is not None else [
            [int(not isinstance(sampler, DrawnSample)), 0]]
        failed = ranks_where(table, 0)
        if failed:
            where = on_ranks(group, failed) or f", got {type(sampler).__name__}"
            raise TypeError(f"sampler must be a DrawnSample whose ids the batch listed (with_catalog(features, "
                            f"items)): the sampled mode scores only the rows it looked up{where}")
        failed = ranks_where(table, 1)
        if failed:
            raise ValueError("an item of the sample or head_items " + _UNLISTED + on_ranks(group, failed))
        with self._tower.trusting() if group is not None else contextlib.nullcontext():
            return super().resampled(sampler, head_items=head_items, **kwargs)


class _ListedRows:
    """The item vectors of the ids a sampled batch listed: ``ids [...]`` → ``[..., M, D]``. With ``validate``,
    an id that was not listed is a ``ValueError`` on every rank of ``group``: one exchange per call (the ranks
    call it alike, from the same estimator), except inside :meth:`trusting`, which call sites that every rank
    runs alike enter for ids checked otherwise."""

    def __init__(self, listed: Tensor, vectors: Tensor, group: dist.ProcessGroup | None, validate: bool) -> None:
        self.keys, self.order = listed.sort()
        self.vectors, self.group, self.validate = vectors, group, validate
        self._trusting = False

    @contextlib.contextmanager
    def trusting(self, trust: bool = True) -> Iterator[None]:
        """Calls without the check (an unlisted id then reads some listed row, or zeros if none was); with
        ``trust=False``, with it again."""
        self._trusting, before = trust, self._trusting
        try:
            yield
        finally:
            self._trusting = before

    def listed(self, ids: Tensor) -> Tensor | bool:
        """Whether every id of ``ids`` was listed, on this rank alone."""
        return self._listed(*self._positions(ids))

    def _positions(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``ids`` flattened and each one's position among the sorted listed ids (clamped: safe to read)."""
        flat = ids.reshape(-1).contiguous()  # searchsorted copies (and warns about) a strided one
        if self.keys.numel() == 0:
            return flat, torch.zeros_like(flat)
        return flat, torch.searchsorted(self.keys, flat).clamp(max=self.keys.numel() - 1)

    def _listed(self, flat: Tensor, pos: Tensor) -> Tensor | bool:
        if self.keys.numel() == 0:
            return flat.numel() == 0
        listed = (self.keys[pos] == flat).all()
        return bool(listed) if listed.is_cpu else listed

    def __call__(self, ids: Tensor) -> Tensor:
        flat, pos = self._positions(ids)
        if self.validate and not self._trusting:
            failed = ranks_where(exchange(lambda: [not self._listed(flat, pos)], 1, self.group, flat.device), 0)
            if failed:
                raise ValueError("an item asked of the sampled catalog " + _UNLISTED + on_ranks(self.group, failed))
        if self.keys.numel() == 0:
            return self.vectors.new_zeros(*ids.shape, *self.vectors.shape[1:])
        return self.vectors[self.order[pos]].view(*ids.shape, *self.vectors.shape[1:])


_UNLISTED = ("was not looked up: list it in retriever.with_catalog(features, items) (candidates and shown items must "
             "be; mean-field and plug-in read catalogs of up to 2048 items whole)")


def _group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout ``group`` was created with (None if its backend does not say)."""
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None and hasattr(options, "_timeout"):
            return options._timeout
    return None


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` and its submodules in eval mode (no dropout, batch norm reads its running statistics and
    leaves them alone), each put back as it was."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


_TOWER_CHUNK_ROWS = 8192


def _chunked_tower(tower: nn.Module, rows: Tensor, chunk_size: int) -> Tensor:
    """``tower`` on ``rows [R, W]`` chunk by chunk, each chunk's activations recomputed in backward
    (nothing but the output kept); called once on the empty input when ``R = 0`` so that the tower's
    parameters still take part in the backward (DDP expects every rank to use them)."""
    if rows.shape[0] == 0 or not torch.is_grad_enabled():
        return tower(rows) if rows.shape[0] <= chunk_size else torch.cat([tower(c) for c in rows.split(chunk_size)])
    return torch.cat([checkpoint(tower, c, use_reentrant=False) for c in rows.split(chunk_size)])


class _Scorer(nn.Module):
    """Holds no parameters; calls the retriever's :meth:`TwoTowerRetriever._scores`. A module without
    sharded submodules is a leaf of TorchRec's pipeline trace, so the catalog is built outside it."""

    def __init__(self, scores: Callable[..., ShardedEmbeddingCatalog | SampledCatalog]) -> None:
        super().__init__()
        self.scores = scores

    def forward(self, features: KeyedJaggedTensor, out: dict[str, JaggedTensor], bags: KeyedTensor | None,
                dense: Tensor | None, masked_items: Tensor | None, sample: DrawnSample | None = None,
                head_items: Tensor | None = None, index_items: Tensor | None = None
                ) -> ShardedEmbeddingCatalog | SampledCatalog:
        return self.scores(features, out, bags, dense, masked_items, sample, head_items, index_items)


def _unpipelined(module: nn.Module, features: KeyedJaggedTensor) -> object:
    """``module(features)`` outside a training pipeline's schedule. ``TrainPipelineSparseDist`` replaces, on the
    instances, a sharded module's forward with one that takes the input distribution it started for the batch in
    flight, and its input distributions' all-to-all with one whose splits it fuses with the other modules'. A
    lookup of other ids (the serving halves, an index head searched in the data loader) runs the module's own
    forward with the all-to-alls' own, between the pipeline's collectives (every rank at the same point)."""
    if "forward" not in vars(module):  # not pipelined
        return module(features)
    replaced = [(dist, vars(dist).pop("forward")) for child in module.modules()
                for dist in (getattr(d, "_dist", None) for d in getattr(child, "_input_dists", ()))
                if dist is not None and "forward" in vars(dist)]
    try:
        return type(module).forward(module, features)
    finally:
        for dist, forward in replaced:
            dist.forward = forward


def _layout(kjt: KeyedJaggedTensor | None, *, ids_cast: bool = False) -> tuple[int, int, int]:
    """``(bytes per length, per value, per weight or 0 without weights)`` of a KJT (``-1`` each for None): TorchRec's
    all-to-all of a sharded lookup exchanges its buffers as they are, so ranks must agree on them (a mismatch aborted
    the job inside gloo). ``with_catalog`` gives ``features`` int64 lengths and values, as ``user_vectors`` does
    before its lookup (``ids_cast``)."""
    if kjt is None:
        return -1, -1, -1
    weights = kjt.weights_or_none()
    ids = (8, 8) if ids_cast else (kjt.lengths().element_size(), kjt.values().element_size())
    return *ids, 0 if weights is None else weights.element_size()


_LAYOUT_SIZE = len(_layout(None))


def _check_layouts(layouts: list[tuple[int, ...]]) -> None:
    """``ValueError`` (on every rank: each passes the same table) where the ranks' ``features`` and ``bag_features``
    layouts (:func:`_layout`, one after the other) differ."""
    if len(set(layouts)) > 1:
        raise ValueError(f"features and bag_features must each have one layout on every rank (TorchRec's lookup "
                         f"exchanges their buffers as they are): lengths, values and weights of one dtype, weights "
                         f"everywhere or nowhere; got (bytes per length, per value, per weight or 0 without weights) "
                         f"of features then bag_features {[tuple(e) for e in layouts]} by rank")


def _mean_pool(values: Tensor, lengths: Tensor, batch_size: int) -> Tensor:
    """Mean of each of the first ``batch_size`` samples' rows: ``values [Σ lengths, W]``, ``lengths [S]``
    (``S >= batch_size``: later samples are dropped) → ``[batch_size, W]`` (0 if a sample has none)."""
    owner = torch.repeat_interleave(torch.arange(lengths.shape[0], device=values.device), lengths)
    total = values.new_zeros((lengths.shape[0], values.shape[1])).index_add(0, owner, values)
    return (total / lengths.clamp(min=1).unsqueeze(1).to(values.dtype))[:batch_size]
