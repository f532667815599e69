"""How a DataLoader worker hands batches over on Linux: built in reused shared-memory slots, read out by the training
process, each slot taken again only once its batch was read and dropped; the fallbacks, and no file left behind."""

import contextlib
import gc
import glob
import math
import mmap
import multiprocessing
import os
import pickle
import socket
import time
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from capg_rec.logs import LoggedBatch, LoggedImpressions
from capg_rec.logs import _handover
from tests.test_logs_parquet import _assert_same, _batch, _write

pytestmark = pytest.mark.skipif(not _handover._SUPPORTED, reason="the pool needs Linux and /dev/shm")


@pytest.fixture
def in_worker(monkeypatch):
    """This process as a DataLoader worker (and its own training process), with pools of its own."""
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: types.SimpleNamespace(id=0, num_workers=1))
    for name, value in (("_pools", {}), ("_maps", {}), ("_unsent", [])):
        monkeypatch.setattr(_handover, name, value)
    yield _handover._pools
    for pool in _handover._pools.values():
        pool.finalizer.cancel()  # its worker's exit: this process's, long after its fd is closed
        _handover._unlink(os.path.join(_handover._SHM_DIR, pool.name))
        pool.tokens.close()
        os.close(pool.fd)
    _handover._close_sockets()


def _in_pool(batch):
    return any(0 <= batch.candidates.data_ptr() - p.address < p.size * _handover._SLOTS
               for p in _handover._pools.values())


def _send(batch):
    return bytes(ForkingPickler.dumps(batch))


def _reader(tmp_path, rows=200, batch_size=4):
    """A reader, and copies of what it reads (each slot free again once its batch is copied)."""
    _write(tmp_path / "a.parquet", [rows])
    data = LoggedImpressions(tmp_path, batch_size)
    return data, [LoggedBatch(*(None if x is None else x.clone() for x in b)) for b in data]


def test_a_batch_built_in_a_slot_goes_over_as_its_layout(tmp_path, in_worker):
    data, want = _reader(tmp_path, rows=90)
    for i, batch in enumerate(data):
        assert _in_pool(batch)
        message = _send(batch)
        assert len(message) < 2048 and b"_from_pool" in message  # the layout, not the values
        got = pickle.loads(message)
        _assert_same(got, want[i])
        assert not _in_pool(got) and not got.candidates.is_shared()  # copied out: the slot can go back
    assert i == len(want) - 1 and len(in_worker) == 1 and len(_handover._maps) == 1
    assert not glob.glob(os.path.join(_handover._SHM_DIR, next(iter(in_worker.values())).name))  # unlinked once mapped


def test_an_epoch_s_last_shorter_batch_takes_a_slot_of_the_same_pool(tmp_path, in_worker):
    data, want = _reader(tmp_path, rows=2100, batch_size=1000)
    sizes = [sum(x.nbytes for x in b if x is not None) for b in want]
    assert sizes[0] > 2 * _handover._MIN_SLOT_BYTES and sizes[-1] < _handover._MIN_SLOT_BYTES  # a smaller class
    for i, batch in enumerate(data):
        assert _in_pool(batch)
        _assert_same(pickle.loads(_send(batch)), want[i])
    assert i == 2 and len(in_worker) == 1


def test_a_slot_is_taken_again_only_once_its_batch_was_read_and_dropped(tmp_path, in_worker):
    """A batch the worker keeps (a shuffle buffer) keeps its slot, whether it was sent or not; one sent and never
    read keeps it for good. With no slot free a batch is made and pickled the plain way, whole."""
    data, want = _reader(tmp_path)
    it = iter(data)
    kept = [next(it) for _ in range(_handover._SLOTS)]
    assert all(map(_in_pool, kept))
    spare = next(it)
    assert not _in_pool(spare) and b"_from_arrays" in _send(spare)  # no slot free: in-band
    _assert_same(pickle.loads(_send(spare)), want[_handover._SLOTS])

    read = pickle.loads(_send(kept[0]))  # read, but still held here
    assert not _in_pool(next(it))
    del kept[0]
    gc.collect()
    assert _in_pool(next(it))  # read and dropped: free (and now held by the batch just made, dropped at once)
    lost = _send(kept[0])  # sent, never read
    del kept[0], lost
    gc.collect()
    fresh = [next(it) for _ in range(2)]  # the slot dropped above, then none: the lost one stays taken
    assert [_in_pool(b) for b in fresh] == [True, False]
    dropped_unsent = kept.pop(0)
    del dropped_unsent
    gc.collect()
    assert _in_pool(next(it))  # never sent: free once dropped

    for i, batch in enumerate(kept):  # the batches kept all along were never overwritten
        _assert_same(batch, want[3 + i])
    _assert_same(read, want[0])


def test_a_batch_is_read_into_host_memory_whatever_the_default_device(tmp_path, in_worker):
    data, want = _reader(tmp_path)
    message = _send(next(iter(data)))
    with torch.device("meta"):
        got = pickle.loads(message)
    assert got.candidates.device.type == "cpu"
    _assert_same(got, want[0])


def test_a_refused_token_of_a_pool_no_longer_mapped_is_dropped(in_worker):
    _handover._unsent.append(("capg_rec-1-gone", _handover._TOKEN.pack(0, 1)))
    _handover._send_tokens()
    assert not _handover._unsent


def test_a_message_whose_pool_is_gone_raises(tmp_path, in_worker):
    """A message read where its pool's file no longer exists (read by another process first, or after its worker
    exited) names that."""
    data, _ = _reader(tmp_path)
    message = _send(next(iter(data)))
    _handover._unlink(os.path.join(_handover._SHM_DIR, next(iter(in_worker.values())).name))
    with pytest.raises(RuntimeError, match="no longer exists"):
        pickle.loads(message)


def test_a_message_read_after_its_slot_was_taken_again_raises(tmp_path, in_worker):
    data, want = _reader(tmp_path)
    it = iter(data)
    batch = next(it)
    message = _send(batch)
    _assert_same(pickle.loads(message), want[0])
    _assert_same(pickle.loads(message), want[0])  # read twice before the slot is reused: the same values
    del batch
    gc.collect()
    assert _in_pool(next(it))
    with pytest.raises(RuntimeError, match="read twice"):
        pickle.loads(message)


def _slot(batch, pool):
    return (batch.candidates.data_ptr() - pool.address) // pool.size


def test_a_stale_token_frees_no_slot(tmp_path, in_worker):
    """A datagram that gives a slot back for an earlier generation (delayed or repeated) leaves the slot's batch
    there until its own message is read."""
    data, want = _reader(tmp_path)
    it = iter(data)
    batch = next(it)
    pool = next(iter(in_worker.values()))
    slot, old = _slot(batch, pool), pool.generation[_slot(batch, pool)]
    _assert_same(pickle.loads(_send(batch)), want[0])
    del batch
    gc.collect()
    kept = next(it)
    assert _slot(kept, pool) == slot and pool.generation[slot] != old
    message = _send(kept)
    del kept
    gc.collect()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as reply:
        reply.sendto(_handover._TOKEN.pack(slot, old), "\0" + pool.name)
    others = [next(it) for _ in range(_handover._SLOTS - 1)]
    assert all(map(_in_pool, others)) and not _in_pool(next(it))
    _assert_same(pickle.loads(message), want[1])


def _send_first(data, queue, done):
    queue.put(_send(next(iter(data))))
    done.wait(60)  # the pool's file lives until its worker exits


def test_a_forked_child_makes_pools_of_its_own(tmp_path, in_worker):
    """A process forked from a worker (whose pools it inherits) hands its batches over through pools of its own (in
    the parent's, the parent's next batch took the slot the child had written its batch in), and leaves the parent's
    pool files alone."""
    data, want = _reader(tmp_path)
    it = iter(data)
    kept = next(it)
    context = multiprocessing.get_context("fork")
    queue, done = context.Queue(), context.Event()
    child = context.Process(target=_send_first, args=(data, queue, done))
    child.start()
    try:
        message = queue.get(timeout=60)
        later = next(it)
        _assert_same(pickle.loads(message), want[0])
    finally:
        done.set()
        child.join(60)
    _assert_same(kept, want[0])
    _assert_same(later, want[1])
    _assert_same(pickle.loads(_send(kept)), want[0])  # the child left the parent's pool (and its file) alone


def test_a_batch_pickled_twice_goes_the_second_time_by_copy(tmp_path, in_worker):
    """Each message stays readable whatever happens to the other and to the batch (sent twice from its slot, the
    second message would have read the slot's next batch once the first was read and the batch dropped)."""
    data, want = _reader(tmp_path)
    it = iter(data)
    batch = next(it)
    first, second = _send(batch), _send(batch)
    _assert_same(pickle.loads(first), want[0])
    del batch
    gc.collect()
    assert _in_pool(next(it))
    _assert_same(pickle.loads(second), want[0])


def test_a_batch_made_elsewhere_is_copied_into_a_slot(tmp_path, in_worker):
    """Plain batches (every field dtype the reducer takes, absent fields, no rows) and one whose field was replaced
    after it was read go through a slot by copy; the batch read stays where it is and goes later without one."""
    data, _ = _reader(tmp_path)
    read = next(iter(data))
    odd = LoggedBatch(torch.arange(3), torch.zeros(3, 2, dtype=torch.int8), torch.ones(3, 1, dtype=torch.bool),
                      torch.randn(3, 1).half(), torch.randn(3, 1, dtype=torch.float64), None,
                      torch.randn(3, dtype=torch.float64), torch.randint(9, (3, 4), dtype=torch.int16),
                      torch.arange(3, dtype=torch.int32))
    for batch in (_batch(5, 0), odd, _batch(0, 1), read._replace(rewards=read.rewards + 1)):
        message = _send(batch)
        assert b"_from_pool" in message and len(message) < 2048
        _assert_same(pickle.loads(message), batch)
    assert _in_pool(read)
    _assert_same(pickle.loads(_send(read)), read)


def test_a_full_dev_shm_gives_plain_batches_in_band(tmp_path, in_worker, monkeypatch):
    """No slot's space can be reserved: batches are made in the worker's own memory (one storage each, as always) and
    go in-band whatever their size, with no shared-memory block of their own (a small /dev/shm that the pools had
    filled then failed there, found by review); the reservation is tried again only after a while."""
    def full(*args):
        attempts.append(args)
        if len(attempts) == 1:
            raise OSError(28, "No space left on device")
        return reserve(*args)

    attempts, reserve = [], os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", full)
    data, want = _reader(tmp_path, rows=4100, batch_size=4000)
    got = list(data)
    assert [len(b.context) for b in got] == [4000, 100] and not any(map(_in_pool, got))
    assert not got[0].rewards.is_shared()
    assert got[0].rewards.untyped_storage().data_ptr() == got[0].candidates.untyped_storage().data_ptr()
    for batch, expected in zip(got, want):
        message = _send(batch)
        assert b"_from_arrays" in message
        _assert_same(pickle.loads(message), expected)
    assert len(attempts) == 1  # not per batch and per pickling (each filled /dev/shm for a moment before)
    next(iter(in_worker.values())).retry_at = 0.0  # the while has passed, and there is room now
    assert _in_pool(next(iter(data))) and len(attempts) == 2


def test_slots_are_reserved_as_they_are_first_needed(tmp_path, in_worker):
    """A pool reserves in /dev/shm only the slots it has needed at once (all six, for every worker, before: a
    small /dev/shm ran out, found by review)."""
    data, want = _reader(tmp_path)
    for i, batch in enumerate(data):
        _assert_same(pickle.loads(_send(batch)), want[i])
    pool = next(iter(in_worker.values()))
    assert sum(pool.reserved) == 2  # the batch being made, and the one before it still referenced
    assert os.fstat(pool.fd).st_blocks * 512 == 2 * pool.size


def test_a_worker_gives_its_slots_space_back_at_exit_but_for_unread_batches(tmp_path, in_worker):
    """At a worker's exit the space of its slots goes back to /dev/shm though the training process still maps the
    file (it held it until some new pool came: a small /dev/shm stayed full, found by review); a batch whose message
    was not read keeps its slot's space and reads whole."""
    data, want = _reader(tmp_path)
    it = iter(data)
    batches = [next(it) for _ in range(3)]
    for batch, expected in zip(batches[:2], want):
        _assert_same(pickle.loads(_send(batch)), expected)
    unread = _send(batches[2])
    pool = next(iter(in_worker.values()))
    assert os.fstat(pool.fd).st_blocks * 512 == 3 * pool.size
    pool._release(os.path.join(_handover._SHM_DIR, pool.name))  # what the worker's exit runs
    assert os.fstat(pool.fd).st_blocks * 512 == pool.size
    _assert_same(pickle.loads(unread), want[2])
    late = _send(_batch(3, 0))  # the queue's feeder thread may pickle a batch after that: in-band, not in the space
    assert b"_from_arrays" in late and sum(pool.reserved) == 1  # given back (a SIGBUS once /dev/shm was full again)
    assert not _in_pool(next(it))


def test_reads_close_the_mappings_of_exited_workers_pools(tmp_path, in_worker, monkeypatch):
    """Every read, in-band ones too, closes (at most once a second) the mappings of pools whose workers have exited:
    a loop stopped early leaves its prefetched slots' space mapped, and on a full /dev/shm no new pool (whose first
    read was the only other chance) could be made, so every later batch went in-band (found by review)."""
    data, _ = _reader(tmp_path)
    pickle.loads(_send(next(iter(data))))  # a live worker's pool (this process's), mapped
    exited = multiprocessing.get_context("fork").Process(target=int)
    exited.start()
    exited.join()
    name = f"capg_rec-{exited.pid}-gone"
    _handover._maps[name] = (mmap.mmap(-1, 4096), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
    reply = _handover._maps[name][1]
    monkeypatch.setattr(_handover, "available", lambda: False)
    message = _send(_batch(3, 0))
    assert b"_from_arrays" in message
    _handover._swept = time.monotonic()
    pickle.loads(message)
    assert name in _handover._maps  # not within the second
    _handover._swept = 0.0
    pickle.loads(message)
    assert name not in _handover._maps and reply.fileno() == -1 and len(_handover._maps) == 1


def test_slot_sizes_take_four_values_an_octave():
    """At most 25% of a slot is left unused, and batches that grow make few pools (one per 64 KiB step made 80
    pools for batches growing to 5.6 MiB, found by review)."""
    sizes = [_handover._slot_size(n) for n in range(0, 8 << 20, 4096)]
    assert all(size >= n + _handover._HEADER for size, n in zip(sizes, range(0, 8 << 20, 4096)))
    assert all(size <= 1.25 * (n + _handover._HEADER) or size == _handover._MIN_SLOT_BYTES
               for size, n in zip(sizes, range(0, 8 << 20, 4096)))
    assert len(set(sizes)) <= 4 * 7 + 1


def test_fields_from_two_slots_go_by_copy(tmp_path, in_worker):
    """A batch whose fields lie in two slots is copied (as a layout in the first slot, the second slot's field would be
    read after that slot, never sent, had been taken again)."""
    data, want = _reader(tmp_path)
    it = iter(data)
    first, second = next(it), next(it)
    message = _send(first._replace(rewards=second.rewards))
    del second
    gc.collect()
    assert _in_pool(next(it))
    _assert_same(pickle.loads(message), want[0]._replace(rewards=want[1].rewards))


def test_every_slot_and_a_batch_a_header_short_of_a_slot_come_back_whole(in_worker):
    """All six slots sent at once and read; batches whose values alone would fit a slot but not with its 64-byte
    header take the next size (their last bytes would have run into the next slot's generation)."""
    size = _handover._MIN_SLOT_BYTES - _handover._HEADER // 2
    batches = [_batch(3, i)._replace(features=torch.randn(size // 4, generator=torch.Generator().manual_seed(i)))
               for i in range(_handover._SLOTS)]
    batches = [b._replace(features=b.features[:(size - sum(x.nbytes for x in b[:-2] if x is not None)) // 4])
               for b in batches]
    _send(_batch(3, 9))  # a pool of the smallest slots first: a near-full batch must not take them
    messages = [_send(b) for b in batches]
    assert sorted(in_worker) == [_handover._MIN_SLOT_BYTES, _handover._MIN_SLOT_BYTES * 5 // 4]
    for message, batch in zip(messages, batches):
        _assert_same(pickle.loads(message), batch)


def test_a_token_that_a_full_queue_refuses_is_sent_again(tmp_path, in_worker):
    """A worker's socket queue holds few datagrams: a slot's token refused there is sent with the next read, so the
    slot comes back (it was lost for good, found by review with a validation loader of 12 workers)."""
    data, want = _reader(tmp_path)
    it = iter(data)
    batch = next(it)
    pool = next(iter(in_worker.values()))
    slot = _slot(batch, pool)
    first = _send(batch)
    del batch
    gc.collect()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
        other.setblocking(False)
        while True:  # fill the worker's queue
            try:
                other.sendto(b"", "\0" + pool.name)
            except BlockingIOError:
                break
        _assert_same(pickle.loads(first), want[0])
        assert _handover._unsent and not pool.back[slot]
        kept = [next(it) for _ in range(_handover._SLOTS - 1)]  # the worker drains its queue: the others
        _assert_same(pickle.loads(_send(kept[0])), want[1])  # a read sends the refused token too
    assert pool.take() == slot and not _handover._unsent  # the only slot free: the one given back late


def test_a_pool_whose_tokens_are_not_read_leaves_the_others_alone(tmp_path, in_worker):
    """Datagrams not yet read count against the socket that sent them: each pool's tokens go through a socket of
    their own, so one that fills (an idle worker, which reads its tokens only when it makes a batch) refuses no other
    pool's (through one shared socket, 47 idle pools were enough to stop every other worker's slots, found by
    review)."""
    data, want = _reader(tmp_path)
    big = _batch(3, 1)._replace(features=torch.zeros(_handover._MIN_SLOT_BYTES // 4))  # a pool of larger slots
    _assert_same(pickle.loads(_send(big)), big)
    large = max(in_worker.values(), key=lambda pool: pool.size)
    reply, idle = _handover._maps[large.name][1], []
    with contextlib.ExitStack() as stack:
        while True:  # idle sockets holding datagrams from its reply socket, until that socket's buffer is full
            idle.append(stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)))
            idle[-1].bind(f"\0capg_rec-test-{len(idle)}-{large.name}")
            sent = 0
            while True:
                try:
                    reply.sendto(b"x", f"\0capg_rec-test-{len(idle)}-{large.name}")
                    sent += 1
                except BlockingIOError:
                    break
            if not sent:
                break
        for i, batch in enumerate(data):  # the small pool's slots keep coming back
            assert _in_pool(batch)
            _assert_same(pickle.loads(_send(batch)), want[i])
        assert not _handover._unsent


def test_a_worker_forked_while_another_thread_holds_the_lock_runs(tmp_path):
    """A DataLoader worker forked while a thread of the training process holds the hand-over's lock (reading another
    loader's batch) gets a lock of its own: it waited for that lock for good (found by review: 9 of 100 validation
    loaders started beside a training loader hung)."""
    _write(tmp_path / "a.parquet", [40])
    data = LoggedImpressions(tmp_path, 4)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=1, timeout=60)
    with _handover._lock:
        it = iter(loader)  # forks the worker
    assert len(list(it)) == 10


def test_a_pool_nobody_mapped_is_unlinked_by_its_worker(tmp_path):
    """A loader stopped once its worker has made a pool and before any batch was read: the worker unlinks the file."""
    _write(tmp_path / "a.parquet", [40] * 5)
    it = iter(torch.utils.data.DataLoader(LoggedImpressions(tmp_path, 4), batch_size=None, num_workers=1))
    pids = [w.pid for w in it._workers]
    deadline = time.monotonic() + 60
    while not _pool_files(pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _pool_files(pids)
    del it
    gc.collect()
    assert not _pool_files(pids)


def _pool_files(pids):
    return [f for pid in pids for f in glob.glob(os.path.join(_handover._SHM_DIR, f"capg_rec-{pid}-*"))]


@pytest.mark.parametrize("persistent", [False, True])
def test_no_pool_file_outlives_its_loader_and_dead_workers_mappings_are_closed(tmp_path, persistent):
    """Whether an epoch is read whole, stopped after one batch or before any: the training process unlinks what it
    mapped, the worker what nobody mapped. Each new pool closes the mappings of workers that have exited."""
    _write(tmp_path / "a.parquet", [40] * 5)
    data = LoggedImpressions(tmp_path, 4)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2, persistent_workers=persistent)
    pids, sockets = set(), []
    for stop in (None, 1, 0, None):
        it = iter(loader)
        pids |= {w.pid for w in it._workers}
        sockets += [reply for _, reply in _handover._maps.values()]
        got = [batch for _, batch in zip(range(10**6 if stop is None else stop), it)]
        assert len(got) == (50 if stop is None else stop)
        del it, got
        gc.collect()
    del loader
    gc.collect()
    assert not _pool_files(pids)
    assert len(_handover._maps) <= 2  # the last epoch's workers' pools at most
    live = {reply for _, reply in _handover._maps.values()}
    assert all(reply.fileno() == -1 for reply in sockets if reply not in live)  # their sockets closed with them


def test_pool_files_of_workers_stopped_by_another_worker_s_error_do_not_outlive_the_process(tmp_path):
    """A review found pool files of earlier runs in /dev/shm: when one worker raised on a malformed row group, the
    others had batches in their pools that nobody read, and the process, exiting with the error, had multiprocessing
    terminate those workers (SIGTERM: no finalizer ran). The training process now unlinks its workers' files at exit,
    and each new pool those of workers that are gone."""
    import subprocess
    import sys

    from tests.test_logs_parquet import _set, _table, _write_raw

    cols = _table(30)  # ten row groups of 3 rows: worker 0 fails on its first, 1 and 2 fill their pools meanwhile
    _write_raw(tmp_path / "bad.parquet", _set(cols, "log_inclusion", 0, [math.nan] + cols["log_inclusion"][0][1:]))
    code = (f"import torch\nfrom capg_rec.logs import LoggedImpressions\n"
            f"it = iter(torch.utils.data.DataLoader(LoggedImpressions({str(tmp_path / 'bad.parquet')!r}, 1), "
            f"batch_size=None, num_workers=3))\n"
            f"print([w.pid for w in it._workers], flush=True)\n"
            f"for batch in it:\n    pass\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode != 0 and "is not finite" in done.stderr  # the error, raised in the training process
    pids = eval(done.stdout.strip().splitlines()[0])
    assert not _pool_files(pids)


def test_a_new_pool_unlinks_the_files_of_workers_that_are_gone(tmp_path, in_worker):
    """A worker killed with a batch unread (SIGKILL runs nothing) leaves its file: the next pool made, in any process,
    unlinks it, whatever its name says; a file whose worker lives (it holds the file's lock) stays, whatever its pid:
    a diff review found live files of another pid namespace (containers sharing /dev/shm) unlinked by the pid test,
    and a stray name of a huge pid crashing every read with an OverflowError."""
    import fcntl
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = [os.path.join(_handover._SHM_DIR, f"capg_rec-{pid}-{os.urandom(8).hex()}")
            for pid in (int(dead.stdout), 99999999999, "x")]
    held = os.path.join(_handover._SHM_DIR, f"capg_rec-{int(dead.stdout)}-{os.urandom(8).hex()}")
    for path in (*gone, held):
        open(path, "wb").close()
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)  # as a live worker of another pid namespace holds its pool
    try:
        _handover.buffer(100)  # this worker's first pool
        assert not any(os.path.exists(path) for path in gone) and os.path.exists(held)
        assert all(os.path.exists(os.path.join(_handover._SHM_DIR, pool.name)) for pool in in_worker.values())
    finally:
        os.close(holder)
        for path in (*gone, held):
            _handover._unlink(path)
