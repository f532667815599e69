"""Parquet logs: writer/reader round trip, batching, sharding over ranks and DataLoader workers, and a
ValueError naming file, row group, row and column for each kind of malformed file."""

import math
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from capg_rec.logs import LOG_SCHEMA, LoggedBatch, LoggedImpressions, LogWriter, explore_candidates, \
    log_propensities, write_logs
from capg_rec.logs.schema import LogMetadata

N, K, L, F = 30, 5, 2, 3


def _batch(rows, seed, features=True, start=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, N, generator=g)
    cands = explore_candidates(logits, K, epsilon=0.2, generator=g)
    shown = cands[:, [3, 0]]
    logged = log_propensities(logits, cands, shown, epsilon=0.2)
    return LoggedBatch(torch.randint(100, (rows,), generator=g), cands, shown, torch.randn(rows, L, generator=g),
                       *logged, features=torch.randn(rows, F, generator=g) if features else None,
                       request_id=torch.arange(start, start + rows))


def _write(path, sizes, features=True, start=0, **kwargs):
    batches = []
    with LogWriter(path, num_candidates=K, num_shown=L, num_items=N, num_features=F if features else None,
                   policy_version="v1", extra={"env": "test"}, **kwargs) as writer:
        for i, rows in enumerate(sizes):
            batches.append(_batch(rows, i, features, start))
            writer.write(batches[-1])
            start += rows
    return batches


def _cat(batches):
    return LoggedBatch(*(None if x[0] is None else torch.cat(x) for x in zip(*batches)))


def _assert_same(a, b):
    for name, x, y in zip(LoggedBatch._fields, a, b):
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


def _as_written(batch):
    return batch._replace(rewards=batch.rewards.float(), log_inclusion=batch.log_inclusion.double(),
                          log_expected_count=batch.log_expected_count.double(),
                          log_candidate_prob=batch.log_candidate_prob.double())


@pytest.mark.parametrize("features", [True, False])
@pytest.mark.parametrize("batch_size", [1, 7, 64, 1000])
def test_round_trip(tmp_path, features, batch_size):
    path = tmp_path / "logs.parquet"
    written = _cat([_as_written(b) for b in _write(path, [10, 25, 1, 40], features)])
    data = LoggedImpressions(path, batch_size)
    assert data.num_rows == 76 and data.meta.num_candidates == K and data.meta.extra == {"env": "test"}
    got = list(data)
    assert [len(b.context) for b in got][:-1] == [batch_size] * (len(got) - 1)
    assert 0 < len(got[-1].context) <= batch_size
    _assert_same(_cat(got), written)
    assert pq.ParquetFile(path).num_row_groups == 4
    assert pq.read_table(path, columns=["policy_version"]).column(0).unique().to_pylist() == ["v1"]


def test_drop_last_columns_and_row_group_size(tmp_path):
    path = tmp_path / "logs.parquet"
    _write(path, [50], row_group_size=8)
    assert pq.ParquetFile(path).num_row_groups == 7
    got = list(LoggedImpressions(path, 16, drop_last=True, columns=["shown", "log_inclusion"]))
    assert [len(b.shown) for b in got] == [16, 16, 16]
    assert got[0].candidates is None and got[0].features is None and got[0].log_inclusion.dtype == torch.float64


def test_shuffled_row_groups_cover_the_file_once(tmp_path):
    path = tmp_path / "logs.parquet"
    _write(path, [5] * 12)
    plain = torch.cat([b.request_id for b in LoggedImpressions(path, 5)])
    a = torch.cat([b.request_id for b in LoggedImpressions(path, 5, shuffle_row_groups=True, seed=1)])
    b = torch.cat([b.request_id for b in LoggedImpressions(path, 5, shuffle_row_groups=True, seed=1)])
    data = LoggedImpressions(path, 5, shuffle_row_groups=True, seed=1)
    data.set_epoch(1)
    c = torch.cat([b.request_id for b in data])
    assert torch.equal(a, b) and not torch.equal(a, plain) and not torch.equal(a, c)
    assert torch.equal(a.sort().values, plain) and torch.equal(c.sort().values, plain)


def test_two_ranks_two_workers_partition_the_files(tmp_path):
    """The union over 2 ranks × 2 DataLoader workers is exactly the files' rows, none twice."""
    _write(tmp_path / "a.parquet", [6, 7, 8, 9, 10])
    batches = _write(tmp_path / "b.parquet", [3, 4], start=1000)
    seen = []
    for rank in range(2):
        data = LoggedImpressions(tmp_path, 4, rank=rank, world_size=2, shuffle_row_groups=True)
        loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2)
        got = list(loader)
        ids = [int(r) for b in got for r in b.request_id]
        assert ids
        seen += ids
        # What num_batches announces is what the workers yield (a numbering of the shards unlike the reader's,
        # worker-major, announced 5 where 4 came: a review's mutation that no test caught).
        assert data.num_batches(num_workers=2) == len(got), rank
    assert len(seen) == len(set(seen)) == 40 + 7
    assert sorted(seen) == [*range(40), *range(1000, 1007)]
    assert set(range(1000, 1007)) == {int(r) for b in batches for r in b.request_id}


def _same_batches(got, want):
    for a, b in zip(got, want, strict=True):
        assert type(a) is LoggedBatch
        for x, y in zip(a, b, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x, y)


class _MyBatch(LoggedBatch):
    __slots__ = ()


def test_batches_go_between_processes_in_band_when_small_and_plain():
    """For multiprocessing (ForkingPickler: a DataLoader worker's queue) a small batch of plain host tensors pickles
    in-band as numpy arrays, values, dtypes, shapes and absent fields kept; a batch the user put in shared memory
    stays shared, and a large, strided (an expanded one would be written out whole), bfloat16 or grad-requiring one
    pickles as tensors do. pickle, deepcopy and torch.save are untouched: a subclass keeps its type, torch.load its
    map_location (found by review of the first version, which overrode LoggedBatch's own pickling)."""
    import copy
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers its tensor reducers with ForkingPickler)

    from capg_rec.logs.schema import IN_BAND_BYTES

    def fork_dump(b):
        return bytes(ForkingPickler.dumps(b))

    batch = _batch(4, 0)._replace(request_id=None)
    data = fork_dump(batch)
    assert b"_from_arrays" in data
    back = pickle.loads(data)
    _same_batches([back], [batch])
    assert back.candidates.numpy().flags.writeable
    shared = batch._replace(rewards=batch.rewards.clone().share_memory_())
    big = batch._replace(features=torch.zeros(IN_BAND_BYTES // 4 + 1))
    for odd in (shared, big, batch._replace(rewards=batch.rewards.bfloat16()),
                batch._replace(rewards=batch.rewards.clone().requires_grad_()),
                batch._replace(features=torch.ones(1).expand(4, 3))):
        assert b"_from_arrays" not in fork_dump(odd)
    assert pickle.loads(fork_dump(shared)).rewards.is_shared()

    assert b"_from_arrays" not in pickle.dumps(batch)
    mine = _MyBatch(*batch)
    assert type(pickle.loads(pickle.dumps(mine))) is _MyBatch and type(copy.deepcopy(mine)) is _MyBatch
    buffer = io.BytesIO()
    torch.save(batch, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False, map_location="meta").rewards.is_meta


@pytest.mark.parametrize("sizes, batch_size", [([5, 6, 7], 4), ([5000, 3000], 6000)])
def test_a_worker_hands_over_the_batches_read_in_process(tmp_path, sizes, batch_size):
    """Through a DataLoader worker the batches are those read in process, field for field: on Linux through the
    worker's pool (copied out of it, whatever their size); elsewhere small ones in-band, large ones (over 512 KiB)
    made in shared memory."""
    from capg_rec.logs import _handover
    from capg_rec.logs.schema import IN_BAND_BYTES

    _write(tmp_path / "a.parquet", sizes)
    data = LoggedImpressions(tmp_path, batch_size)
    got, want = list(torch.utils.data.DataLoader(data, batch_size=None, num_workers=1)), list(data)
    _same_batches(got, want)
    large = sum(x.nbytes for x in want[0] if x is not None) > IN_BAND_BYTES
    assert large == (batch_size > 1000) and got[0].rewards.is_shared() == (large and not _handover._SUPPORTED)


def test_workers_started_by_spawn_read_their_rank_s_share(tmp_path, monkeypatch):
    """Rank and world size from torch.distributed reach DataLoader workers that a spawn start made (they have no
    process group to ask): such a worker read every rank's rows before."""
    _write(tmp_path / "a.parquet", [4] * 6)
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    data = LoggedImpressions(tmp_path, 4)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    ids = sorted(int(r) for b in loader for r in b.request_id)
    mine = sorted(int(r) for b in LoggedImpressions(tmp_path, 4, rank=1, world_size=2) for r in b.request_id)
    assert ids == mine and len(ids) == 12 and data.num_batches(1) == 3


def test_persistent_workers_follow_set_epoch(tmp_path):
    """A persistent DataLoader worker keeps its copy of the reader: set_epoch reaches it all the same (before, every
    epoch after the first repeated the first one's order)."""
    _write(tmp_path / "a.parquet", [2] * 8)
    data = LoggedImpressions(tmp_path, 2, shuffle_row_groups=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=1, persistent_workers=True)
    orders, expected = [], []
    for epoch in range(3):
        data.set_epoch(epoch)
        orders.append([int(b.request_id[0]) for b in loader])
        expected.append([int(b.request_id[0]) for b in data])
    assert orders == expected and orders[0] != orders[1] != orders[2]
    held_out = data.subset([0, 1])  # a subset keeps its own epoch
    held_out.set_epoch(7)
    assert data.epoch == 2 and held_out.epoch == 7
    for numpy_ids in (list(np.arange(2)), np.arange(2)):  # numpy's ints too, and an array of them (a review)
        assert data.subset(numpy_ids).row_groups == held_out.row_groups
    for bad in ([0.0], np.zeros(2)):
        with pytest.raises(TypeError, match="row_groups"):
            data.subset(bad)


def test_seeds_of_any_size_and_no_collisions(tmp_path):
    """Seeds of 64 bits shuffle (before, seeds above ~9e12 overflowed mid-iteration, naming nothing), and (seed,
    epoch) pairs whose product mix agreed, such as (1, 0) and (0, 1_000_003), give their own orders."""
    _write(tmp_path / "a.parquet", [1] * 12)

    def order(seed, epoch):
        data = LoggedImpressions(tmp_path, 1, shuffle_row_groups=True, seed=seed)
        data.set_epoch(epoch)
        return [int(b.request_id[0]) for b in data]

    assert sorted(order(2**63 + 5, 0)) == list(range(12))
    assert order(1, 0) != order(0, 1_000_003)


def test_no_columns_is_a_value_error(tmp_path):
    _write(tmp_path / "a.parquet", [4])
    with pytest.raises(ValueError, match="columns must name at least one"):
        LoggedImpressions(tmp_path, 4, columns=[])


def test_fingerprint_sees_the_rows(tmp_path):
    """Rewriting a file with two rewards swapped keeps its size and footer statistics; the fingerprint changes all
    the same (it hashed only the sizes and footers before)."""
    path = tmp_path / "a.parquet"
    cols = _table()
    _write_raw(path, cols)
    before = LoggedImpressions(path, 4).fingerprint()
    cols["rewards"][1], cols["rewards"][2] = cols["rewards"][2], cols["rewards"][1]
    _write_raw(path, cols)
    data = LoggedImpressions(path, 4)
    assert data.fingerprint() != before and data.fingerprint() == data.fingerprint()


def test_write_logs_and_empty_batch(tmp_path):
    batch = _as_written(_batch(9, 0, features=False))
    write_logs(tmp_path / "one.parquet", batch, num_items=N, method="exact")
    data = LoggedImpressions(tmp_path / "one.parquet", 4)
    assert data.meta.method == "exact" and data.meta.num_features is None
    _assert_same(_cat(list(data)), batch)
    with LogWriter(tmp_path / "empty.parquet", num_candidates=K, num_shown=L) as writer:
        writer.write(_batch(0, 0, features=False))
    assert list(LoggedImpressions(tmp_path / "empty.parquet", 4)) == []



def test_writer_takes_batches_on_any_device_and_with_grad(tmp_path, device):
    """The writer checks a batch where it lies (CUDA too: its checks read numpy copies; they called .numpy() on the
    device tensors before) and one whose propensities still track gradients, and both read back as written."""
    batch = _as_written(_batch(9, 0))
    moved = LoggedBatch(*(None if x is None else x.to(device) for x in batch))
    moved = moved._replace(log_inclusion=moved.log_inclusion.clone().requires_grad_())
    write_logs(tmp_path / "d.parquet", moved, num_items=N)
    _assert_same(_cat(list(LoggedImpressions(tmp_path / "d.parquet", 4))), batch)
    row5 = torch.tensor([5], device=device)
    bad = moved._replace(log_inclusion=moved.log_inclusion.detach().index_fill(0, row5, 1.0))
    with pytest.raises(ValueError, match="row 5: column 'log_inclusion' is a propensity > 1"):
        write_logs(tmp_path / "e.parquet", bad, num_items=N)

# ------------------------------------------------------------------------------------------ malformed files

def _table(rows=6, nullable=False):
    """A valid table of ``rows`` rows as Python lists (to corrupt), and its schema."""
    b = _as_written(_batch(rows, 3))
    cols = {"request_id": b.request_id.tolist(), "context": b.context.tolist(), "features": b.features.tolist(),
            "candidates": b.candidates.tolist(), "shown": b.shown.tolist(), "rewards": b.rewards.tolist(),
            "log_inclusion": b.log_inclusion.tolist(), "log_expected_count": b.log_expected_count.tolist(),
            "log_candidate_prob": b.log_candidate_prob.tolist(), "policy_version": ["v"] * rows}
    return cols


def _write_raw(path, cols, drop=None, meta=None, row_group_size=3):
    meta = meta or LogMetadata(K, L, "mean_field", N, F)
    fields = [pa.field(f.name, f.type) for f in LOG_SCHEMA if f.name != drop]
    schema = pa.schema(fields).with_metadata(meta.to_arrow())
    table = pa.Table.from_pydict({f.name: cols[f.name] for f in fields}, schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)


def _set(cols, name, row, value):
    cols[name][row] = value
    return cols


CORRUPTIONS = {
    "candidates too short": (lambda c: _set(c, "candidates", 4, c["candidates"][4][:-1]), "candidates",
                             "must hold 5 values"),
    "shown too long": (lambda c: _set(c, "shown", 4, c["shown"][4] + [c["candidates"][4][1]]), "shown",
                       "must hold 2 values"),
    "rewards too short": (lambda c: _set(c, "rewards", 4, [1.0]), "rewards", "must hold 2 values"),
    "features too long": (lambda c: _set(c, "features", 4, [0.0] * 4), "features", "must hold 3 values"),
    "shown not a candidate": (lambda c: _set(c, "shown", 4, [next(i for i in range(N) if i not in c["candidates"][4]),
                                                             c["shown"][4][1]]), "shown", "shown ⊄ candidates"),
    "repeated candidate": (lambda c: _set(c, "candidates", 4, [c["candidates"][4][0]] * 2 + c["candidates"][4][2:]),
                           "candidates", "repeats"),
    "repeated shown": (lambda c: _set(c, "shown", 4, [c["shown"][4][0]] * 2), "shown", "repeats"),
    "propensity above 1": (lambda c: _set(c, "log_inclusion", 4, [0.01, c["log_inclusion"][4][1]]), "log_inclusion",
                           "> 1"),
    "set propensity above 1": (lambda c: _set(c, "log_candidate_prob", 4, 1e-3), "log_candidate_prob", "> 1"),
    "count above K": (lambda c: _set(c, "log_expected_count", 4, [math.log(K) + 0.1, 0.0]), "log_expected_count",
                      "expected count > K"),
    "zero propensity": (lambda c: _set(c, "log_inclusion", 4, [-math.inf, -1.0]), "log_inclusion", "zero"),
    "NaN propensity": (lambda c: _set(c, "log_expected_count", 4, [math.nan, -1.0]), "log_expected_count",
                       "NaN"),
    "NaN set propensity": (lambda c: _set(c, "log_candidate_prob", 4, math.nan), "log_candidate_prob", "NaN"),
    "null propensity": (lambda c: _set(c, "log_candidate_prob", 4, None), "log_candidate_prob", "null"),
    "null inside a list": (lambda c: _set(c, "log_inclusion", 4, [None, -1.0]), "log_inclusion", "null"),
    "null list": (lambda c: _set(c, "shown", 4, None), "shown", "null"),
    "null context": (lambda c: _set(c, "context", 4, None), "context", "null"),
    "infinite reward": (lambda c: _set(c, "rewards", 4, [math.inf, 0.0]), "rewards", "not finite"),
    "negative infinite reward": (lambda c: _set(c, "rewards", 4, [0.0, -math.inf]), "rewards", "not finite"),
    "NaN feature": (lambda c: _set(c, "features", 4, [0.0, 0.0, math.nan]), "features", "not finite"),
    "infinite propensity": (lambda c: _set(c, "log_inclusion", 4, [-1.0, math.inf]), "log_inclusion", "infinite"),
    "item not in the catalog": (lambda c: _set(c, "candidates", 4, c["candidates"][4][:-1] + [N]), "candidates",
                                f"outside \\[0, {N}\\)"),
    "negative item": (lambda c: _set(c, "candidates", 4, c["candidates"][4][:-1] + [-1]), "candidates",
                      "outside"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_malformed_file_names_file_row_group_row_and_column(tmp_path, case):
    corrupt, column, what = CORRUPTIONS[case]
    path = tmp_path / "bad.parquet"
    _write_raw(path, corrupt(_table()))
    with pytest.raises(ValueError, match=f"{path}, row group 1, row 1 \\(file row 4\\): column '{column}'.*{what}"):
        list(LoggedImpressions(path, 2))


def test_checks_off_reads_bad_values(tmp_path):
    path = tmp_path / "bad.parquet"
    _write_raw(path, CORRUPTIONS["propensity above 1"][0](_table()))
    got = _cat(list(LoggedImpressions(path, 4, validate_args=False)))
    assert got.log_inclusion[4, 0] == 0.01


@pytest.mark.parametrize("case", ["candidates too short", "shown too long", "rewards too short"])
def test_checks_off_still_name_a_wrong_list_length(tmp_path, case):
    """Value checks off: a list column whose lengths do not add up is still a ValueError naming it (not a
    reshape error)."""
    corrupt, column, _ = CORRUPTIONS[case]
    path = tmp_path / "bad.parquet"
    _write_raw(path, corrupt(_table()))
    with pytest.raises(ValueError, match=f"column '{column}' must hold \\d+ values per row"):
        list(LoggedImpressions(path, 4, validate_args=False))


def test_checks_off_still_name_lengths_that_make_up_for_each_other(tmp_path):
    """One row one value short and the next one over: the totals agree, and before, with the value checks off, the
    rows from there on took their neighbours' values silently."""
    cols = _table()
    cols["shown"][1] = cols["shown"][1][:1]
    cols["shown"][2] = cols["shown"][2] + [cols["candidates"][2][4]]
    path = tmp_path / "bad.parquet"
    _write_raw(path, cols, row_group_size=6)
    with pytest.raises(ValueError, match="row group 0, row 1 \\(file row 1\\): column 'shown' must hold 2 values "
                                         "per row, got 1"):
        list(LoggedImpressions(path, 4, validate_args=False))


def test_items_the_new_catalog_lacks(tmp_path):
    path = tmp_path / "logs.parquet"
    _write(path, [10, 10])
    top = int(_cat(list(LoggedImpressions(path, 20))).candidates.max())
    with pytest.raises(ValueError, match=f"column 'candidates' holds an id outside \\[0, {top}\\)"):
        list(LoggedImpressions(path, 20, num_items=top))


def test_bad_file_level_input(tmp_path):
    cols = _table()
    _write_raw(tmp_path / "nocol.parquet", cols, drop="log_inclusion")
    with pytest.raises(ValueError, match="nocol.parquet: missing column 'log_inclusion'"):
        LoggedImpressions(tmp_path / "nocol.parquet", 2)
    _write_raw(tmp_path / "nofeat.parquet", cols, drop="features")
    with pytest.raises(ValueError, match="nofeat.parquet: missing column 'features'"):
        LoggedImpressions(tmp_path / "nofeat.parquet", 2)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "plain.parquet")
    with pytest.raises(ValueError, match="plain.parquet: no capg_rec metadata"):
        LoggedImpressions(tmp_path / "plain.parquet", 2)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="junk.parquet: not a readable Parquet file"):
        LoggedImpressions(tmp_path / "junk.parquet", 2)
    _write_raw(tmp_path / "k4.parquet", cols, meta=LogMetadata(4, L, "mean_field", N, F))
    _write_raw(tmp_path / "k5.parquet", cols)
    with pytest.raises(ValueError, match="num_candidates = 5 differs"):
        LoggedImpressions([tmp_path / "k4.parquet", tmp_path / "k5.parquet"], 2)
    with pytest.raises(ValueError, match="columns"):
        LoggedImpressions(tmp_path / "k5.parquet", 2, columns=["nope"])
    with pytest.raises(ValueError, match="batch_size"):
        LoggedImpressions(tmp_path / "k5.parquet", 0)
    with pytest.raises(ValueError, match="rank"):
        LoggedImpressions(tmp_path / "k5.parquet", 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="nothing-here: not a readable Parquet file"):
        LoggedImpressions(tmp_path / "nothing-here", 2)
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ValueError, match="no .parquet file"):
        LoggedImpressions(tmp_path / "empty-dir", 2)


def test_writer_rejects_bad_batches(tmp_path):
    good = _batch(6, 0)
    with LogWriter(tmp_path / "w.parquet", num_candidates=K, num_shown=L, num_items=N, num_features=F) as writer:
        with pytest.raises(ValueError, match="batch 0 written to .*row 2: column 'log_inclusion' is a propensity > 1"):
            writer.write(good._replace(log_inclusion=good.log_inclusion.index_fill(0, torch.tensor([2]), 0.5)))
        shown = good.shown.clone()
        shown[3, 0] = next(i for i in range(N) if i not in good.candidates[3])
        with pytest.raises(ValueError, match="row 3: column 'shown'.*⊄"):
            writer.write(good._replace(shown=shown))
        with pytest.raises(ValueError, match=r"batch.shown must have shape \[6, 2\] \(the file's num_shown=2\)"):
            writer.write(good._replace(shown=good.candidates))
        for wrong in (torch.float32, torch.complex64, torch.bool):  # review: complex ids lost their imaginary part
            with pytest.raises(TypeError, match=f"batch.candidates must have an integer dtype, got {wrong}"):
                writer.write(good._replace(candidates=good.candidates.to(wrong)))
        for wrong in (torch.int64, torch.complex64, torch.bool):  # as the losses take them: bool rewards were written
            with pytest.raises(TypeError, match=f"batch.rewards must have a floating dtype, got {wrong}"):
                writer.write(good._replace(rewards=good.rewards.to(wrong)))
        with pytest.raises(ValueError, match="batch.features must be a tensor"):
            writer.write(good._replace(features=None))
        with pytest.raises(TypeError, match="LoggedBatch"):
            writer.write(tuple(good))
        with pytest.raises(TypeError, match="batch.context must be a torch.Tensor, got NoneType"):
            writer.write(good._replace(context=None))
        with pytest.raises(ValueError, match=r"batch.context must have shape \[B\], got \[\]"):
            writer.write(good._replace(context=torch.tensor(3)))
        writer.write(good)
    assert LoggedImpressions(tmp_path / "w.parquet", 2).num_rows == 6
    with pytest.raises(ValueError, match="num_shown"):
        LogWriter(tmp_path / "x.parquet", num_candidates=2, num_shown=3)


@pytest.mark.parametrize("options, error, match", [
    (dict(compression="bogus"), ValueError, "compression must be 'none' or a Parquet codec"),
    (dict(compression=None), TypeError, "compression must be a codec name"),
    (dict(extra={"eps": torch.tensor(0.05)}), TypeError, "extra must hold JSON values"),  # numpy's numbers are taken
    (dict(extra=[1]), TypeError, "extra must be a dict"),
])
def test_writer_options_are_checked_before_a_file_is_made(tmp_path, options, error, match):
    """A bad option is an error naming it, and leaves no temporary file behind (an unknown codec left a partial file
    and raised pyarrow's own error before)."""
    with pytest.raises(error, match=match):
        LogWriter(tmp_path / "w.parquet", num_candidates=K, num_shown=L, **options)
    assert list(tmp_path.iterdir()) == []
    with LogWriter(tmp_path / "w.parquet", num_candidates=K, num_shown=L, compression="none") as writer:
        writer.write(_batch(3, 0, features=False))
    assert LoggedImpressions(tmp_path / "w.parquet", 2).num_rows == 3


def test_reader_converts_without_row_loops(tmp_path):
    """The list columns come out of the flat values buffers: a sliced (offset) batch converts right."""
    path = tmp_path / "logs.parquet"
    written = _cat([_as_written(b) for b in _write(path, [33], row_group_size=33)])
    got = _cat(list(LoggedImpressions(path, 10)))  # batches of 10 out of one row group of 33
    _assert_same(got, written)
    assert np.array_equal(got.candidates.numpy(), written.candidates.numpy())


def test_files_must_agree_on_the_catalog_and_method(tmp_path):
    """Regression: with several files, ids were checked against the first file's catalog size only (none
    at all if it recorded none), and a second file's method was ignored. The files must now agree on both,
    unless the reader is given num_items, against which every file's ids are then checked."""
    cols = _table()
    _write_raw(tmp_path / "a.parquet", cols, meta=LogMetadata(K, L, "mean_field", 100, F))
    _write_raw(tmp_path / "b.parquet", cols, meta=LogMetadata(K, L, "mean_field", N, F))
    _write_raw(tmp_path / "c.parquet", cols, meta=LogMetadata(K, L, "plugin", 100, F))
    with pytest.raises(ValueError, match=f"b.parquet: num_items = {N} differs"):
        LoggedImpressions([tmp_path / "a.parquet", tmp_path / "b.parquet"], 2)
    with pytest.raises(ValueError, match="c.parquet: method = plugin differs"):
        LoggedImpressions([tmp_path / "a.parquet", tmp_path / "c.parquet"], 2)
    both = LoggedImpressions([tmp_path / "a.parquet", tmp_path / "b.parquet"], 2, num_items=100)
    assert both.num_rows == 2 * len(cols["shown"])
    assert _cat(list(both)).candidates.shape[0] == 2 * len(cols["shown"])


@pytest.mark.parametrize("num_items", ["20", 0, -5, True])
def test_malformed_catalog_size_in_the_metadata_is_named(tmp_path, num_items):
    """A recorded num_items that is not an int >= 1: a ValueError naming the file and the field (before: a
    TypeError from a comparison, or a range check against [0, -5))."""
    _write_raw(tmp_path / "bad.parquet", _table(), meta=LogMetadata(K, L, "mean_field", num_items, F))
    with pytest.raises(ValueError, match="bad.parquet: metadata num_items must be an int >= 1"):
        LoggedImpressions(tmp_path / "bad.parquet", 2)


def test_a_writer_replaces_the_file_only_when_it_closes(tmp_path):
    """The file appears at its path on close; a with block that raises leaves an existing file as it was and
    no partial file behind."""
    path = tmp_path / "logs.parquet"
    first = _write(path, [7, 5])
    with pytest.raises(RuntimeError, match="stop"), LogWriter(path, num_candidates=K, num_shown=L, num_items=N,
                                                              num_features=F) as writer:
        writer.write(_batch(3, 9))
        assert LoggedImpressions(path, 4).num_rows == 12  # the old file, while the new one is written
        raise RuntimeError("stop")
    _assert_same(_cat(list(LoggedImpressions(path, 100))), _cat([_as_written(b) for b in first]))
    assert [p.name for p in tmp_path.iterdir()] == ["logs.parquet"]
    second = _write(path, [4])
    _assert_same(_cat(list(LoggedImpressions(path, 100))), _cat([_as_written(b) for b in second]))


@pytest.mark.parametrize("meta, message", [
    (LogMetadata(2, 3, "mean_field", N, F), r"metadata num_shown must be <= num_candidates=2 \(.*\), got 3"),
    (LogMetadata(K, L, "mean_field", K - 1, F),
     f"metadata num_items must be >= num_candidates={K} \\(.*\\), got {K - 1}"),
], ids=["L > K", "N < K"])
def test_metadata_the_writer_refuses_is_refused_by_the_reader(tmp_path, meta, message):
    """Another pipeline's file with such metadata was read (review): unchecked, or with only some columns read, it
    gave batches of L shown items among K < L candidates."""
    _write_raw(tmp_path / "meta.parquet", _table(), meta=meta)
    for kwargs in ({}, {"validate_args": False}, {"columns": ["context"]}):
        with pytest.raises(ValueError, match=f"meta.parquet: {message}"):
            LoggedImpressions(tmp_path / "meta.parquet", 2, **kwargs)


def test_reader_and_writer_arguments_from_review(tmp_path):
    """Each was a raw or misleading error: an empty list of paths was a TypeError, a list holding None or a bytes
    path a bare one not naming the argument, a generator of columns was read up by its check (iteration then failed
    with StopIteration), an epoch beyond int64 a RuntimeError of torch; NaN in extra was written as JSON that other
    readers refuse."""
    _write(tmp_path / "good.parquet", [6])
    with pytest.raises(ValueError, match="path_or_paths must name at least one path, got an empty list"):
        LoggedImpressions([], 2)
    for paths in ([None], b"good.parquet", [tmp_path / "good.parquet", 3]):
        with pytest.raises(TypeError, match="path_or_paths must be a path, a directory or a list of paths"):
            LoggedImpressions(paths, 2)
    data = LoggedImpressions(tmp_path / "good.parquet", 6, columns=(c for c in ["context", "shown"]))
    assert data.columns == ["context", "shown"] and len(list(data)) == 1
    with pytest.raises(TypeError, match="columns must be a list of column names"):
        LoggedImpressions(tmp_path / "good.parquet", 6, columns=(c for c in ["context", 3]))
    with pytest.raises(ValueError, match=r"epoch must be in \[0, 9223372036854775807\], got 9223372036854775808"):
        data.set_epoch(2**63)
    for extra in ({"x": math.nan}, {"x": [math.inf]}):
        with pytest.raises(ValueError, match="extra must hold finite numbers"):
            LogWriter(tmp_path / "w.parquet", num_candidates=K, num_shown=L, extra=extra)
    with pytest.raises(ValueError, match="path must be in an existing folder, got .*missing/w.parquet"):  # it named
        LogWriter(tmp_path / "missing" / "w.parquet", num_candidates=K, num_shown=L)  # the hidden partial file


def test_a_folder_is_read_as_pyarrow_datasets_read_one(tmp_path):
    """Regressions (found by review), each a silent loss of rows before its fix: a folder was read one level deep, and
    only its files ending in lower-case ``.parquet`` (Hive-style partitions, ``date=.../part.parquet``, and
    ``PART.PARQUET`` were skipped). Names starting with ``.`` or ``_`` stay out, as pyarrow.dataset leaves them."""
    parts = {"a.parquet": [3], "date=2024-01-02/b.parquet": [4], "date=2024-01-03/x/c.PARQUET": [5],
             ".hidden.parquet": [6], "_tmp/d.parquet": [7], "date=2024-01-04/_e.parquet": [8]}
    written = {}
    for name, sizes in parts.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        written[name] = _write(tmp_path / "w.parquet", sizes)
        (tmp_path / "w.parquet").rename(tmp_path / name)
    data = LoggedImpressions(tmp_path, 100)
    assert [f.relative_to(tmp_path).as_posix() for f in data.files] == ["a.parquet", "date=2024-01-02/b.parquet",
                                                                        "date=2024-01-03/x/c.PARQUET"]
    _assert_same(_cat(list(data)), _as_written(_cat([b for name in list(parts)[:3] for b in written[name]])))
    # a linked partition folder is searched (found by review: Path.rglob does not follow links), and a link back
    # into the tree lists nothing twice
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (tmp_path / "date=2024-01-02" / "b.parquet").rename(elsewhere / "b.parquet")
    (tmp_path / "date=2024-01-02").rmdir()
    (tmp_path / "date=2024-01-02").symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / "date=2024-01-03" / "x" / "loop").symlink_to(tmp_path / "date=2024-01-03", target_is_directory=True)
    assert [f.relative_to(tmp_path).as_posix() for f in LoggedImpressions(tmp_path, 100).files] == [
        "a.parquet", "date=2024-01-02/b.parquet", "date=2024-01-03/x/c.PARQUET"]


def test_integer_rewards_and_features_are_read_as_floats(tmp_path):
    """Regression (found by review): clicks stored as integers (0 and 1) were refused, though narrower integer ids
    and other float types read."""
    _write(tmp_path / "good.parquet", [6])
    table = pq.read_table(tmp_path / "good.parquet")
    clicks = pa.array([[1, 0]] * 6, type=pa.list_(pa.int8()))
    counts = pa.array([[2, 0, 7]] * 6, type=pa.large_list(pa.int64()))
    table = table.set_column(table.schema.get_field_index("rewards"), "rewards", clicks)
    table = table.set_column(table.schema.get_field_index("features"), "features", counts)
    pq.write_table(table, tmp_path / "ints.parquet")
    (batch,) = LoggedImpressions(tmp_path / "ints.parquet", 6)
    assert batch.rewards.dtype == batch.features.dtype == torch.float32
    assert batch.rewards.tolist() == [[1.0, 0.0]] * 6 and batch.features.tolist() == [[2.0, 0.0, 7.0]] * 6
    bad = table.set_column(table.schema.get_field_index("log_inclusion"), "log_inclusion",
                           pa.array([[0, 0]] * 6, type=pa.list_(pa.int64())))
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"column 'log_inclusion' must have type list<item: double> \(or another "
                                         r"list layout, or float type read as it\)"):
        LoggedImpressions(tmp_path / "bad.parquet", 6)
    numbered = table.set_column(table.schema.get_field_index("policy_version"), "policy_version",
                                pa.array([7] * 6, type=pa.int64()))  # its message named integer types
    pq.write_table(numbered, tmp_path / "numbered.parquet")
    with pytest.raises(ValueError, match=r"column 'policy_version' must have type string \(or another string "
                                         r"\(dictionary-encoded too\) type read as it\), got int64"):
        LoggedImpressions(tmp_path / "numbered.parquet", 6)
    # and as booleans (a review: a list<bool> click column, as pipelines write one, was refused)
    table = table.set_column(table.schema.get_field_index("rewards"), "rewards",
                             pa.array([[True, False]] * 6, type=pa.list_(pa.bool_())))
    table = table.set_column(table.schema.get_field_index("features"), "features",
                             pa.array([[False, True, True]] * 6, type=pa.list_(pa.bool_())))
    pq.write_table(table, tmp_path / "bools.parquet")
    (batch,) = LoggedImpressions(tmp_path / "bools.parquet", 6)
    assert batch.rewards.dtype == batch.features.dtype == torch.float32
    assert batch.rewards.tolist() == [[1.0, 0.0]] * 6 and batch.features.tolist() == [[0.0, 1.0, 1.0]] * 6


def test_a_flipped_bit_in_a_page_is_an_error(tmp_path):
    """Regression (a review): LogWriter wrote no page checksums and the reader verified none, so a bit flipped in a
    page that still decodes came back as another value (a propensity of 0.999 read as 1.0, with no error). Pages are
    now written with CRCs and verified when read."""
    import struct

    _write(tmp_path / "good.parquet", [6], compression="none")
    data = bytearray((tmp_path / "good.parquet").read_bytes())
    value = float(pq.read_table(tmp_path / "good.parquet").column("log_inclusion")[3][1].as_py())
    at = bytes(data).find(struct.pack("<d", value))
    assert at > 0  # uncompressed: the float's bytes lie in the file as they are
    data[at] ^= 1  # the lowest bit of the mantissa: a value a hair away, still in range
    (tmp_path / "flipped.parquet").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="flipped.parquet, row group 0 cannot be read: .*CRC checksum"):
        list(LoggedImpressions(tmp_path / "flipped.parquet", 2))


def test_file_level_gaps_in_the_schema_are_named(tmp_path):
    """Malformed files that were read silently or with another error: a null policy version (never read,
    so never checked), a column twice (a bare KeyError), a negative id in a file that records no catalog
    size, metadata whose method or extra has the wrong type, and a corrupted data page (pyarrow's OSError,
    naming no file)."""
    cols = _table()
    _write_raw(tmp_path / "pv.parquet", _set(_table(), "policy_version", 4, None))
    with pytest.raises(ValueError, match=r"pv.parquet, row group 1, row \d+ \(file row 4\): column 'policy_version' "
                                         r"is missing"):
        LoggedImpressions(tmp_path / "pv.parquet", 2)
    with pytest.raises(ValueError, match="column 'policy_version' is missing"):  # nulls raise either way (found by
        LoggedImpressions(tmp_path / "pv.parquet", 2, validate_args=False)   # review: read without the checks)
    _write(tmp_path / "good.parquet", [6])
    table = pq.read_table(tmp_path / "good.parquet")
    twice = table.append_column(pa.field("candidates", pa.list_(pa.int64())), table.column("candidates"))
    pq.write_table(twice.replace_schema_metadata(table.schema.metadata), tmp_path / "twice.parquet")
    with pytest.raises(ValueError, match=r"twice.parquet: column\(s\) \['candidates'\] appear more than once"):
        LoggedImpressions(tmp_path / "twice.parquet", 2)
    for name in ("candidates", "shown"):  # shown read without the candidates: checked on its own
        _write_raw(tmp_path / "neg.parquet", _set(_table(), name, 4, cols[name][4][:-1] + [-1]),
                   meta=LogMetadata(K, L, "mean_field", None, F))
        with pytest.raises(ValueError, match=f"row 1 \\(file row 4\\): column '{name}' holds a negative id"):
            list(LoggedImpressions(tmp_path / "neg.parquet", 2, columns=[name]))
    for meta in (LogMetadata(K, L, 3, N, F), LogMetadata(K, L, "mean_field", N, F, extra=[1, 2])):
        _write_raw(tmp_path / "meta.parquet", cols, meta=meta)
        with pytest.raises(ValueError, match="meta.parquet: metadata method must be a str and extra a dict"):
            LoggedImpressions(tmp_path / "meta.parquet", 2)
    flipped = bytearray((tmp_path / "good.parquet").read_bytes())
    for i in range(200, 400):
        flipped[i] ^= 0xFF
    (tmp_path / "flipped.parquet").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="flipped.parquet, row group 0 cannot be read"):
        list(LoggedImpressions(tmp_path / "flipped.parquet", 2))


def test_writer_and_null_check_corner_cases(tmp_path):
    """A struct column before policy_version shifted the null check onto another column (Parquet counts one
    leaf column per field); a folder as path failed only at close and left a hidden file. A writer left open
    and collected is discarded with a ResourceWarning, leaving the path as it was (a later review: closing it then,
    as pyarrow's own writer does, replaced existing logs with the partial file of a job that failed outside a with
    block)."""
    import gc

    _write(tmp_path / "good.parquet", [6])
    table = pq.read_table(tmp_path / "good.parquet")
    at = table.schema.get_field_index("policy_version")
    note = pa.array([None] * 6, pa.struct([("a", pa.int64()), ("b", pa.int64())]))
    for nulls in (False, True):
        versions = pa.array([None if nulls and i == 4 else "v1" for i in range(6)], pa.string())
        t = table.set_column(at, "policy_version", versions).add_column(at, "note", note)
        pq.write_table(t.replace_schema_metadata(table.schema.metadata), tmp_path / "struct.parquet")
        if nulls:
            with pytest.raises(ValueError, match="column 'policy_version' is missing"):
                LoggedImpressions(tmp_path / "struct.parquet", 4)
        else:
            assert LoggedImpressions(tmp_path / "struct.parquet", 4).num_rows == 6
    with pytest.raises(ValueError, match="path must be a file to create, got the folder"):
        LogWriter(tmp_path, num_candidates=K, num_shown=L)
    open_writer = LogWriter(tmp_path / "open.parquet", num_candidates=K, num_shown=L, num_items=N, num_features=F)
    other = LogWriter(tmp_path / "open.parquet", num_candidates=K, num_shown=L, num_items=N, num_features=F)
    assert open_writer._partial != other._partial  # two writers of one path keep apart
    other.discard()
    for p in tmp_path.glob("*.parquet"):
        p.unlink()  # the folder holds only the logs below
    write_logs(tmp_path / "open.parquet", _as_written(_batch(5, 0)), num_items=N)
    open_writer.write(_batch(3, 0))
    with pytest.warns(UserWarning, match="open.parquet was never closed: the path was left as it was, and its 3 rows "
                                         "are in .*open.parquet.unclosed"):
        del open_writer
        gc.collect()
    assert LoggedImpressions(tmp_path / "open.parquet", 4).num_rows == 5  # the logs that were there
    assert LoggedImpressions(tmp_path, 4).num_rows == 5  # the folder's logs: not the unclosed file
    kept = tmp_path / "open.parquet.unclosed"
    assert pq.ParquetFile(kept).metadata.num_rows == 3  # nothing lost: finished beside, to look at
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial") or p.name.startswith(".")]


def _rewrite(src, dst, retype):
    """The file ``src`` written again to ``dst`` with each column's type given by ``retype(name, type)``."""
    table = pq.read_table(src)
    schema = pa.schema([pa.field(f.name, retype(f.name, f.type), nullable=f.nullable) for f in table.schema],
                       metadata=table.schema.metadata)
    pq.write_table(table.cast(schema), dst, row_group_size=4)


def _other_layouts(name, t):
    """Spark / Polars-style types: non-nullable elements named ``element``, large and fixed-size lists,
    int32 ids, float64 rewards and features, float32 propensities, large strings."""
    if pa.types.is_list(t):
        value = t.value_type
        value = {pa.int64(): pa.int32(), pa.float32(): pa.float64(), pa.float64(): pa.float32()}.get(value, value)
        element = pa.field("element", value, nullable=False)
        width = {"candidates": K, "features": F}.get(name, L)
        return {"candidates": pa.large_list(element), "features": pa.list_(element, width)}.get(
            name, pa.list_(element))
    return {pa.int64(): pa.int32(), pa.float64(): pa.float32(), pa.string(): pa.large_string()}[t]


def test_the_layouts_data_pipelines_write_are_read(tmp_path):
    """Regression: list elements declared non-nullable (Spark's containsNull = false, pyarrow with an explicit
    schema), large or fixed-size lists (Polars) and int32 ids were refused as the wrong type. They are read, as
    the schema's dtypes, to the same values."""
    batches = _write(tmp_path / "ours.parquet", [7, 5])
    _rewrite(tmp_path / "ours.parquet", tmp_path / "theirs.parquet", _other_layouts)
    kinds = {str(f.type) for f in pq.read_schema(tmp_path / "theirs.parquet")}
    assert {"large_list<element: int32 not null>", "fixed_size_list<element: double not null>[3]"} <= kinds
    got = _cat(list(LoggedImpressions(tmp_path / "theirs.parquet", 5)))
    want = _as_written(_cat(batches))
    float32 = {"log_inclusion", "log_expected_count", "log_candidate_prob"}  # stored as float32 in that file
    want = want._replace(**{name: getattr(want, name).float().double() for name in float32})
    _assert_same(got, want)
    # a dictionary-encoded version, as pandas writes a categorical (refused before; found by review)
    _rewrite(tmp_path / "ours.parquet", tmp_path / "categorical.parquet",
             lambda name, t: pa.dictionary(pa.int8(), pa.string()) if name == "policy_version" else t)
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "categorical.parquet").field("policy_version").type)
    _assert_same(_cat(list(LoggedImpressions(tmp_path / "categorical.parquet", 5))), _as_written(_cat(batches)))
    table = pq.read_table(tmp_path / "ours.parquet")  # a dictionary of numbers (Parquet reads back int64): refused
    at = table.schema.get_field_index("policy_version")
    numbers = pa.array([1] * table.num_rows, pa.int64()).dictionary_encode()
    pq.write_table(table.set_column(at, "policy_version", numbers).replace_schema_metadata(table.schema.metadata),
                   tmp_path / "numbers.parquet")
    with pytest.raises(ValueError, match="column 'policy_version' must have type string .*got int64"):
        LoggedImpressions(tmp_path / "numbers.parquet", 5)
    for bad, what in ((pa.uint64(), "uint64"), (pa.string(), "string")):
        _rewrite(tmp_path / "ours.parquet", tmp_path / "bad.parquet",
                 lambda name, t: bad if name == "context" else t)
        with pytest.raises(ValueError, match=f"column 'context' must have type int64 .*got {what}"):
            LoggedImpressions(tmp_path / "bad.parquet", 5)


@pytest.mark.parametrize("case", ["null context", "null inside a list", "null list"])
def test_nulls_raise_with_checks_off_too(tmp_path, case):
    """Regression: with validate_args=False a null id came back as a float64 NaN (the column turned into
    floats) instead of an error."""
    corrupt, column, what = CORRUPTIONS[case]
    path = tmp_path / "bad.parquet"
    _write_raw(path, corrupt(_table()))
    with pytest.raises(ValueError, match=f"column '{column}'.*{what}"):
        list(LoggedImpressions(path, 2, validate_args=False))


@pytest.mark.parametrize("span", [7, 1000, 2**62])
def test_the_subset_check_is_the_row_by_row_comparison(span):
    """The reader's shown ⊂ candidates check is a binary search in each row (a [n, L, K] comparison and a torch
    sort made the checked reader 1.5x slower); it agrees with the comparison, negative and far-apart ids included."""
    from capg_rec.logs.parquet import _rows_hold

    rng = np.random.default_rng(span % 1000)
    for _ in range(20):
        ordered = np.sort(rng.integers(-span, span, size=(64, 6)), axis=1)
        ids = np.where(rng.random((64, 3)) < 0.8, ordered[np.arange(64)[:, None], rng.integers(0, 6, (64, 3))],
                       rng.integers(-span, span, size=(64, 3)))
        want = (ids[:, :, None] == ordered[:, None, :]).any(2).all(1)
        np.testing.assert_array_equal(_rows_hold(ordered, ids), want)
    assert _rows_hold(ordered[:, :0], ids).sum() == 0 and _rows_hold(ordered, ids[:, :0]).all()


@pytest.mark.parametrize("column, value", [("rewards", [1e300, 0.5]), ("features", [0.0, -1e39, 1.0])])
def test_wider_floats_beyond_float32_are_named_not_read_as_inf(tmp_path, column, value):
    """Regression (found by review): float64 rewards or features beyond float32's range passed the finiteness check
    (taken in float64) and were read as ±inf (cast after it)."""
    cols = _set(_table(), column, 4, value)
    schema = pa.schema([pa.field(f.name, pa.list_(pa.float64()) if f.name == column else f.type) for f in LOG_SCHEMA])
    table = pa.Table.from_pydict({f.name: cols[f.name] for f in schema}, schema=schema.with_metadata(
        LogMetadata(K, L, "mean_field", N, F).to_arrow()))
    pq.write_table(table, tmp_path / "wide.parquet", row_group_size=3)
    with pytest.raises(ValueError, match=f"row group 1, row 1 \\(file row 4\\): column '{column}' is not finite "
                                         "\\(NaN or inf\\) in float32"):
        list(LoggedImpressions(tmp_path / "wide.parquet", 2))
    cols = _set(_table(), column, 4, [3e38 if i == 0 else 0.0 for i in range(len(value))])  # within float32's range
    table = pa.Table.from_pydict({f.name: cols[f.name] for f in schema}, schema=table.schema)
    pq.write_table(table, tmp_path / "wide.parquet", row_group_size=3)
    got = getattr(_cat(list(LoggedImpressions(tmp_path / "wide.parquet", 2))), column)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()


def test_one_write_is_one_row_group_however_large(tmp_path):
    """Regression (found by review): a write of more than 1,048,576 rows became two row groups (pyarrow's default
    cap), where the docs say one per write()."""
    rows = 1_100_000
    cands = torch.arange(K).expand(rows, K)
    logged = torch.full((rows, L), -1.0, dtype=torch.float64)
    batch = LoggedBatch(torch.zeros(rows, dtype=torch.long), cands, cands[:, :L], torch.zeros(rows, L), logged, logged,
                        logged[:, 0])
    with LogWriter(tmp_path / "big.parquet", num_candidates=K, num_shown=L, validate_args=False) as writer:
        writer.write(batch)
    assert pq.ParquetFile(tmp_path / "big.parquet").metadata.num_row_groups == 1


def test_write_logs_and_writer_arguments_are_checked(tmp_path):
    """Regression (found by review): write_logs read the batch's shapes before any check (a bare IndexError or
    AttributeError), took num_candidates twice (Python's own TypeError), and a writer stored any method name."""
    good = _batch(4, 0)
    for bad, error, match in (
            (good._replace(candidates=good.candidates[:, 0]), ValueError, "batch.candidates must have 2"),
            (good._replace(shown=None), TypeError, "batch.shown must be a torch.Tensor"),
            (good._replace(candidates=good.candidates.tolist()), TypeError, "batch.candidates must be"),
            (good._replace(features=good.features[:, 0]), ValueError, "batch.features must have 2"),
            (good._replace(shown=good.candidates[:, :L + 1]), ValueError,  # says where L came from (a review)
             rf"batch.rewards must have shape \[4, {L + 1}\] \(the file's num_shown={L + 1}\)")):
        with pytest.raises(error, match=match):
            write_logs(tmp_path / "w.parquet", bad, num_items=N)
    with pytest.raises(TypeError, match=r"write_logs reads \['num_candidates'\] off the batch"):
        write_logs(tmp_path / "w.parquet", good, num_candidates=K)
    assert not list(tmp_path.iterdir())


def test_the_method_stored_is_a_name_or_the_registered_name_of_an_instance(tmp_path):
    """A later review: an instance was stored as its repr (so train --logs could not match it with the method it
    is), and refusing unregistered names blocked logs whose propensities come from another system."""
    from capg_rec import Exact, MeanField

    for method, stored in ((MeanField(), "mean_field"), (Exact(), "exact"), ("prod_ranker_v3", "prod_ranker_v3")):
        write_logs(tmp_path / "m.parquet", _as_written(_batch(4, 0)), num_items=N, method=method)
        assert LoggedImpressions(tmp_path / "m.parquet", 2).meta.method == stored


def test_narrow_and_wide_float_columns_are_checked_at_their_exact_bounds(tmp_path):
    """A later review of the fast checks: a float16 column was compared with its bound rounded to float16 (an
    expected count above K passed), the float32 range was cast to float16 (an overflow warning on every read, an
    error under -W error), and a float64 reward that rounds to a finite float32 was refused."""
    def write(column, value_type, row_value):
        cols = _set(_table(), column, 4, row_value)
        schema = pa.schema([pa.field(f.name, pa.list_(value_type) if f.name == column else f.type) for f in LOG_SCHEMA])
        table = pa.Table.from_pydict({f.name: cols[f.name] for f in schema},
                                     schema=schema.with_metadata(LogMetadata(K, L, "mean_field", N, F).to_arrow()))
        pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
        return tmp_path / "t.parquet"

    above = float(np.float16(math.log(K) + 1e-3))  # a float16 number above log K + tolerance
    with pytest.raises(ValueError, match="row 1 \\(file row 4\\): column 'log_expected_count' is an expected count"):
        list(LoggedImpressions(write("log_expected_count", pa.float16(), [above, -1.0]), 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _cat(list(LoggedImpressions(write("rewards", pa.float16(), [1.5, -2.0]), 2))).rewards
    assert got[4].tolist() == [1.5, -2.0]
    finite = 3.4028234663852886e38 + 2.0**100  # above float32's largest, below the half step that rounds to inf
    got = _cat(list(LoggedImpressions(write("rewards", pa.float64(), [finite, 0.0]), 2))).rewards
    assert torch.isfinite(got).all() and got[4, 0] == torch.finfo(torch.float32).max


def test_float32_propensities_above_the_bound_by_less_than_a_float32_step_are_named(tmp_path):
    """A later review: the failing row was searched for in the column's own float32, where the bound rounds up to
    the value itself (K = 2: float32(log 2 + 1e-6) > log 2 + 1e-6), so the fast check failed but no row was named
    and the file was read."""
    cols = _table()
    cols["candidates"] = [row[:2] for row in cols["candidates"]]  # K = 2, both shown
    cols["shown"] = [row[:2] for row in cols["candidates"]]
    cols["log_expected_count"] = [[-1.0, -1.0] for _ in cols["log_expected_count"]]
    cols["log_expected_count"][4][0] = float(np.float32(math.log(2) + 1e-6))  # above the bound in float64
    assert cols["log_expected_count"][4][0] > math.log(2) + 1e-6
    schema = pa.schema([pa.field(f.name, pa.list_(pa.float32()) if f.name == "log_expected_count" else f.type)
                        for f in LOG_SCHEMA]).with_metadata(LogMetadata(2, L, "mean_field", N, F).to_arrow())
    pq.write_table(pa.Table.from_pydict({f.name: cols[f.name] for f in schema}, schema=schema), tmp_path / "b.parquet",
                   row_group_size=3)
    with pytest.raises(ValueError, match="row 1 \\(file row 4\\): column 'log_expected_count' is an expected count"):
        list(LoggedImpressions(tmp_path / "b.parquet", 2))


def test_two_unclosed_writers_keep_both_their_rows(tmp_path):
    """A later review: a second unclosed writer of a path replaced the first one's rescued rows."""
    import gc

    for rows in (2, 4):
        writer = LogWriter(tmp_path / "d.parquet", num_candidates=K, num_shown=L, num_items=N, num_features=F)
        writer.write(_batch(rows, 0))
        with pytest.warns(UserWarning, match=f"its {rows} rows are in"):
            del writer
            gc.collect()
    assert pq.ParquetFile(tmp_path / "d.parquet.unclosed").metadata.num_rows == 2
    assert pq.ParquetFile(tmp_path / "d.parquet.unclosed.1").metadata.num_rows == 4


def test_reading_works_under_any_default_device(tmp_path):
    """The reader's shared epoch, its shuffle and its batches' host buffers were made on the default device: under
    torch.set_default_device("cuda") reading raised (found by review; "meta" stands in for it here)."""
    path = tmp_path / "a.parquet"
    _write(path, [7, 5, 3])
    want = torch.cat([b.request_id for b in LoggedImpressions(path, 5, shuffle_row_groups=True, seed=1)])
    with torch.device("meta"):
        got = torch.cat([b.request_id for b in LoggedImpressions(path, 5, shuffle_row_groups=True, seed=1)])
    assert got.device.type == "cpu" and torch.equal(got, want)


def test_drop_last_keeps_a_last_batch_that_is_full(tmp_path):
    """``drop_last`` drops only a short last batch: with rows a multiple of the batch size every row comes back, in
    as many batches as num_batches says (a loop that kept a batch only while more than a batch's rows were left
    dropped the last full one: a review's mutation that no test caught)."""
    path = tmp_path / "logs.parquet"
    _write(path, [10, 6])  # 16 rows
    for batch_size in (4, 8, 16, 5):
        data = LoggedImpressions(path, batch_size, drop_last=True)
        got = list(data)
        assert len(got) == data.num_batches() == 16 // batch_size, batch_size
        assert all(len(b.shown) == batch_size for b in got)
        assert sum(len(b.shown) for b in got) == 16 - 16 % batch_size


def test_metadata_that_files_or_this_capg_rec_cannot_agree_on_is_refused(tmp_path):
    """Found by mutation testing (each was accepted by its mutant): files of different L read together even when
    `shown` is not read, an older schema version, and a null num_shown."""
    from tests.logs import set_metadata, write_logs

    two, three = write_logs(tmp_path / "a.parquet", [5]), write_logs(tmp_path / "b.parquet", [5], num_shown=3)
    with pytest.raises(ValueError, match="num_shown = 3 differs"):
        LoggedImpressions([two, three], 4, columns=["context", "candidates"])
    set_metadata(two, schema_version=0)
    with pytest.raises(ValueError, match="schema version 0, this capg_rec reads version 1"):
        LoggedImpressions(two, 4)
    set_metadata(three, num_shown=None)
    with pytest.raises(ValueError, match="metadata num_shown must be an int >= 1, got None"):
        LoggedImpressions(three, 4, columns=["context"])


def test_a_batch_of_negative_views_goes_between_processes():
    """A tensor with its negative bit set (torch's lazy negation) goes between processes with its sign (found by
    mutation testing: numpy refuses such a tensor, and torch's own pickling between processes drops the bit)."""
    from multiprocessing.reduction import ForkingPickler

    x = torch._neg_view(torch.arange(3.0))
    batch = ForkingPickler.loads(ForkingPickler.dumps(LoggedBatch(x, None, None, None, None, None, None)))
    assert torch.equal(batch.context, -torch.arange(3.0))


def test_the_writer_takes_negative_views(tmp_path):
    """Columns with the negative bit set (``torch._neg_view``, ``z.conj().imag``) were a RuntimeError from numpy (found
    by review); they are written with their values."""
    batch = _batch(4, 0)
    neg = batch._replace(rewards=torch._neg_view(-batch.rewards),
                              features=torch._neg_view(-batch.features))
    with LogWriter(tmp_path / "n.parquet", num_candidates=K, num_shown=L, num_items=N, num_features=F) as writer:
        writer.write(neg)
    back = next(iter(LoggedImpressions(tmp_path / "n.parquet", 4)))
    assert torch.equal(back.rewards, batch.rewards.to(back.rewards.dtype))
    assert torch.equal(back.features, batch.features.to(back.features.dtype))


def test_writer_takes_numpy_numbers_in_extra_and_names_a_bad_path(tmp_path):
    """A review's sweep: numpy numbers in extra (or in a LogMetadata) failed JSON's encoder; a path of another type
    gave Python's error naming nothing."""
    from capg_rec.logs import LogMetadata

    with LogWriter(tmp_path / "n.parquet", num_candidates=K, num_shown=L, num_items=N, num_features=F,
                   extra={"a": np.float32(1.5), "b": [np.int64(3)], "c": np.bool_(True),
                          "d": np.array([1.0, 2.0]), "e": np.array(["x", "y"])}) as writer:
        writer.write(_batch(4, 0))
    assert LoggedImpressions(tmp_path / "n.parquet", 2).meta.extra == {"a": 1.5, "b": [3], "c": True, "d": [1.0, 2.0],
                                                                       "e": ["x", "y"]}
    with pytest.raises(TypeError, match="extra must hold JSON values"):  # a tuple key: JSON's error, not plain()'s
        LogWriter(tmp_path / "t.parquet", num_candidates=K, num_shown=L, extra={(1, 2): 3})
    assert LogMetadata(num_candidates=np.int64(10), num_shown=2, method="exact").to_arrow()
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        LogWriter(5, num_candidates=K, num_shown=L)
