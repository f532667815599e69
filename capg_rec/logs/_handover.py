"""How a DataLoader worker hands batches to the training process: through reused shared-memory slots (private).

A worker's pipe moves a batch of a few hundred KiB at about 0.5 GB/s, pickling it costs the worker a copy under
the GIL that its reading waits for, and a fresh shared-memory block per batch costs more to set up than the copy.
So on Linux a DataLoader worker builds each batch in a free slot of its pool, one file in ``/dev/shm`` that each
side maps once, and only the batch's layout goes through the pipe. The training process copies the batch out into
one buffer of its own and gives the slot back with a datagram to the worker's socket (in Linux's abstract
namespace: nothing on disk), whose delivery orders that copy before the worker's next write to the slot.

- A slot is taken again once its batch was read there and no tensor in the worker views it any more (a batch the
  worker keeps, e.g. in a shuffle buffer, keeps its slot). A batch made elsewhere is copied into a slot when it is
  pickled.
- A slot's space is reserved when it is first needed, so a pool holds only the slots its worker has had in use at
  once (two or three with a DataLoader's defaults), and given back when the worker exits (but for slots whose
  batches were not read). With no slot free, or no space in ``/dev/shm`` (tried again only a few seconds later), a
  batch is made in the worker's own memory and goes in-band through the pipe
  (:func:`capg_rec.logs.schema._reduce_for_processes`), whatever its size: it takes no more of ``/dev/shm``.
- The training process gives each pool's slots back through a socket of its own (datagrams not yet read count
  against their sender); a token that a worker's full queue refuses is sent again at the next read. It unlinks a
  pool's file once it has mapped it, and unmaps it once the worker has exited (looked up by the pid in its name,
  when a new pool comes); a worker unlinks its own at exit if nobody did. A killed worker leaves nothing behind once
  its first batch has been read; before that, its file (left also by workers that multiprocessing terminates at the
  training process's exit, after another worker's error, with batches unread) is unlinked once multiprocessing has
  joined them at that exit, or by the next pool made in any process: a worker holds a lock on its pool's file while
  it lives, so a file that no process holds is a leftover, whatever pid namespace made it.
- Each message and slot carry a generation: a message read twice, or a slot overwritten while it is read, raises
  ``RuntimeError`` rather than giving another batch's values.
- A process forked from one that uses pools starts with none of them and a lock of its own.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import math
import mmap
import os
import socket
import struct
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterable
from multiprocessing import util

import numpy as np
import torch
from torch import Tensor

try:
    import fcntl
except ImportError:  # not a POSIX system: no pools there
    fcntl = None

_SHM_DIR = "/dev/shm"
_SUPPORTED = sys.platform == "linux" and os.path.isdir(_SHM_DIR)
_SLOTS = 6
"""Slots per pool: a DataLoader keeps ``prefetch_factor`` (default 2) batches a worker in flight, and the worker
holds the one it builds and the one it hands to its queue."""
_MIN_SLOT_BYTES = 1 << 16
_RETRY_SECONDS = 5.0
_SWEEP_SECONDS = 1.0
_HEADER = 64
"""Bytes at the start of a slot: its generation (8 bytes), then padding to a cache line."""
_TOKEN = struct.Struct("<IQ")
"""A slot read by the training process: its index and the generation it held."""

Layout = tuple[tuple[str, tuple[int, ...], int] | None, ...]
"""Each field's dtype (numpy's name of it), shape and byte offset in its slot's data, or None for an absent field."""

_lock = threading.Lock()
_pools: dict[int, _Pool] = {}  # this worker's, by slot size (bytes)
_maps: dict[str, tuple[mmap.mmap, socket.socket]] = {}  # the pools this process reads from, and a socket for each
_unsent: list[tuple[str, bytes]] = []  # tokens a worker's full queue refused: sent again at the next read
_swept = 0.0  # when the mappings of exited workers' pools were last closed


def _forget() -> None:
    """In a child forked from this process: a lock of its own (another thread may hold this one, for good in the
    child), and none of the parent's pools (whose files only the parent unlinks: ``util.Finalize`` runs in the process
    that made it) or mappings."""
    global _lock
    _lock = threading.Lock()
    _pools.clear()
    _maps.clear()
    _unsent.clear()


def _close_sockets() -> None:
    for _, reply in _maps.values():
        reply.close()


def _sweep_files(keep: str = "") -> None:
    """Unlink the pool files in ``/dev/shm`` that no live worker holds (its lock goes with its last fd, whatever
    ended it): those of workers terminated with a batch unread (by multiprocessing at the training process's exit,
    after another worker's error) or killed. A locked file is left, whichever process or pid namespace holds it, and
    so are ``keep`` and files this process may not open (another user's)."""
    try:
        names = [n for n in os.listdir(_SHM_DIR) if n.startswith("capg_rec-")]
    except OSError:
        return
    own = {pool.name for pool in _pools.values()} | {keep}
    for name in names:
        if name in own:
            continue
        path = os.path.join(_SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone already, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its worker lives
            pass
        else:
            _unlink(path)
        finally:
            os.close(fd)


if _SUPPORTED:
    os.register_at_fork(after_in_child=_forget)
    atexit.register(_close_sockets)
    # After multiprocessing has terminated and joined this process's daemonic children (its DataLoader workers) at
    # exit: the files of those that still held unread batches (finalizers below priority 0 run after that).
    util.Finalize(None, _sweep_files, exitpriority=-100)


def available() -> bool:
    """Whether batches made and pickled here go through a pool: in a DataLoader worker, on Linux."""
    return _SUPPORTED and torch.utils.data.get_worker_info() is not None


class _Pool:
    """A worker's ``_SLOTS`` slots of ``size`` bytes in one mapped file, and the socket their tokens come back to.

    A slot is free when no tensor here views it (``held``) and it was not sent (``sent``) or was read since
    (``back``); taking it starts a new generation. The file's space is reserved slot by slot, when a slot is first
    taken (``reserved``): a pool holds in ``/dev/shm`` only the slots it has needed at once (two or three, with a
    DataLoader's defaults), and a full ``/dev/shm`` fails there, not as a SIGBUS at a write. After a failure the
    pool tries again only :data:`_RETRY_SECONDS` later."""

    def __init__(self, size: int) -> None:
        _sweep_files()  # what earlier workers left
        self.name = f"capg_rec-{os.getpid()}-{uuid.uuid4().hex}"
        self.size = size
        path = os.path.join(_SHM_DIR, self.name)
        hidden = os.path.join(_SHM_DIR, "." + self.name)  # no sweep looks at it before it is locked
        self.fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Held while this worker lives (its fd open): a sweep, in any process or pid namespace sharing /dev/shm,
            # leaves a locked file alone.
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            os.ftruncate(self.fd, size * _SLOTS)  # sparse: nothing reserved yet
            self.map = mmap.mmap(self.fd, size * _SLOTS)
            os.rename(hidden, path)
        except OSError:
            os.close(self.fd)
            _unlink(hidden)
            raise
        self.reserved = [False] * _SLOTS
        self.retry_at = 0.0
        self.address = np.frombuffer(self.map, np.uint8).ctypes.data
        self.tokens = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.tokens.bind("\0" + self.name)
        self.tokens.setblocking(False)
        self.dropped: collections.deque[int] = collections.deque()  # slots let go of, appended by finalizers
        self.generation = [0] * _SLOTS
        self.held, self.sent, self.back = [False] * _SLOTS, [False] * _SLOTS, [False] * _SLOTS
        self.issued = 0
        self.closed = False  # by _release: a batch pickled later goes in-band
        self.finalizer = util.Finalize(self, self._release, (path,), exitpriority=0)  # run at the worker's exit

    def data(self, slot: int) -> int:
        """The offset in the file of a slot's data."""
        return slot * self.size + _HEADER

    def _collect(self) -> None:
        """The tokens of the slots read since, and the slots no tensor here views any more."""
        while True:
            try:
                token = self.tokens.recv(64)
            except BlockingIOError:
                break
            if len(token) == _TOKEN.size:
                slot, generation = _TOKEN.unpack(token)
                if slot < _SLOTS and self.generation[slot] == generation:  # a stale token frees nothing
                    self.back[slot] = True
        while self.dropped:
            self.held[self.dropped.popleft()] = False

    def take(self) -> int | None:
        """A free slot, marked with a new generation; None if none is."""
        if self.closed:
            return None
        self._collect()
        slot = next((i for i in range(_SLOTS) if not self.held[i] and (self.back[i] or not self.sent[i])), None)
        if slot is None or not self._reserve(slot):
            return None
        self.issued += 1
        self.generation[slot] = self.issued
        self.held[slot] = self.sent[slot] = self.back[slot] = False
        self.map[slot * self.size:slot * self.size + 8] = self.issued.to_bytes(8, "little")
        return slot

    def _reserve(self, slot: int) -> bool:
        """Whether a slot's space is reserved in the file (reserving it now if it was not)."""
        if self.reserved[slot]:
            return True
        if time.monotonic() < self.retry_at:
            return False
        try:
            os.posix_fallocate(self.fd, slot * self.size, self.size)
        except OSError:  # a full /dev/shm
            self.retry_at = time.monotonic() + _RETRY_SECONDS
            return False
        self.reserved[slot] = True
        return True

    def _release(self, path: str) -> None:
        """At the worker's exit: the space of every slot whose batch was read, or never sent, goes back to
        ``/dev/shm`` now, though the training process still maps the file (until its next :func:`sweep`); a slot
        whose message was not read keeps its batch for its reader. Then the file is unlinked, if nobody did, and a
        batch pickled later goes in-band (it would write to space given back)."""
        with _lock:  # the queue's feeder thread may still pickle batches (in-band from now on)
            self._collect()
            for slot in range(_SLOTS):
                if self.reserved[slot] and (self.back[slot] or not self.sent[slot]):
                    _punch_hole(self.fd, slot * self.size, self.size)
                    self.reserved[slot] = False
            self.closed = True
        _unlink(path)

    def placed(self, fields: tuple[Tensor | None, ...]) -> tuple[int, Layout, int] | None:
        """``(slot, layout, nbytes)`` when every field with values lies in one slot (held: they view it) not sent
        yet."""
        if self.closed:
            return None
        slot, layout, nbytes = None, [], 0
        for x in fields:
            if x is None or not x.numel():
                layout.append(None if x is None else (_numpy_dtype(x), tuple(x.shape), 0))
                continue
            at = x.data_ptr() - self.address
            if slot is None:
                slot = at // self.size if 0 <= at < self.size * _SLOTS else None
                if slot is None or self.sent[slot]:
                    return None
            offset = at - self.data(slot)
            if offset < 0 or offset + x.nbytes > self.size - _HEADER:
                return None
            layout.append((_numpy_dtype(x), tuple(x.shape), offset))
            nbytes = max(nbytes, offset + x.nbytes)
        return None if slot is None else (slot, tuple(layout), nbytes)


_FALLOC_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Free a range of a file's space (Linux's ``fallocate``; best effort)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = getattr(libc, "fallocate64", None) or libc.fallocate
    fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fallocate(fd, _FALLOC_PUNCH_HOLE, offset, length)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pool(nbytes: int) -> _Pool | None:
    """The pool of this worker with the smallest slots that hold ``nbytes`` (an epoch's last, shorter batch takes
    the same), or a new one with slots of the next of four sizes an octave; None if none can be made."""
    fits = [size for size in _pools if size >= _HEADER + nbytes]
    if fits:
        return _pools[min(fits)]
    size = _slot_size(nbytes)
    try:
        pool = _pools[size] = _Pool(size)
    except OSError:
        return None
    return pool


def _slot_size(nbytes: int) -> int:
    """The slot size for a batch of ``nbytes``: four sizes an octave (at most 25% of a slot unused, and few pools for
    batches that grow), at least :data:`_MIN_SLOT_BYTES`."""
    need = _HEADER + nbytes
    step = 1 << max(need.bit_length() - 3, 0)
    return max(_MIN_SLOT_BYTES, -(-need // step) * step)


def buffer(nbytes: int) -> np.ndarray | None:
    """``uint8 [nbytes]`` in a free slot of this worker's pool, for a batch to be built in (as tensors that view it),
    which :func:`send` then hands over without a copy; None when no slot is free."""
    with _lock:
        pool = _pool(nbytes)
        slot = None if pool is None else pool.take()
        if slot is None:
            return None
        array = np.frombuffer(pool.map, np.uint8, nbytes, pool.data(slot))
        weakref.finalize(array, pool.dropped.append, slot)  # once no view of it is left: before the slot is taken again
        pool.held[slot] = True
    return array


def send(fields: tuple[Tensor | None, ...]) -> tuple | None:
    """``fields`` (plain, contiguous host tensors or None) → the arguments of :func:`receive` that give them back:
    of a batch built in a slot (:func:`buffer`), its layout there; of another, its copy into a free slot. None
    when no slot is free."""
    with _lock:
        for pool in _pools.values():
            placed = pool.placed(fields)
            if placed is not None:
                slot, layout, nbytes = placed
                break
        else:
            layout, nbytes = pack(None if x is None else (_numpy_dtype(x), tuple(x.shape)) for x in fields)
            pool = _pool(nbytes)
            slot = None if pool is None else pool.take()
            if slot is None:
                return None
            for x, spec in zip(fields, layout):
                if x is not None and x.numel():
                    out = np.frombuffer(pool.map, np.uint8, x.nbytes, pool.data(slot) + spec[2])
                    out[:] = x.view(-1).view(torch.uint8).numpy()
        pool.sent[slot] = True
        return pool.name, pool.size, slot, pool.generation[slot], nbytes, layout


def receive(name: str, size: int, slot: int, generation: int, nbytes: int, layout: Layout
            ) -> tuple[Tensor | None, ...]:
    """The fields :func:`send` put in a slot, copied out into one buffer of this process (views of one storage, as
    the reader makes them); the slot goes back."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")  # whatever the default device
    with _lock:
        view, _ = _maps.get(name) or _open(name, size)
        start = slot * size
        buffer.numpy()[:] = np.frombuffer(view, np.uint8, nbytes, start + _HEADER)
        if _stamp(view, start) != generation:  # the worker stamps a slot before it writes there
            raise RuntimeError(f"a batch handed over by a DataLoader worker (slot {slot} of {name}) was read after its "
                               "slot was taken again: its message was read twice")
        _unsent.append((name, _TOKEN.pack(slot, generation)))
        _send_tokens()
    sweep()
    return views(buffer.untyped_storage(), layout)


def pack(fields: Iterable[tuple[str, tuple[int, ...]] | None]) -> tuple[Layout, int]:
    """Fields' ``(numpy dtype name, shape)`` (or None: absent) laid out one after the other in one buffer, each at an
    8-byte aligned offset → the layout and the buffer's size in bytes."""
    layout, nbytes = [], 0
    for field in fields:
        layout.append(None if field is None else (*field, nbytes))
        if field is not None:
            nbytes += -(-_ITEMSIZES[field[0]] * math.prod(field[1]) // 8) * 8
    return tuple(layout), nbytes


def views(storage: torch.UntypedStorage, layout: Layout) -> tuple[Tensor | None, ...]:
    """Each field of ``layout`` as a tensor viewing ``storage`` (one ``set_`` each: a quarter of the cost of slicing
    and viewing a tensor)."""
    return tuple(None if spec is None else
                 torch.empty(0, dtype=_TORCH_DTYPES[spec[0]], device=storage.device).set_(
                     storage, spec[2] // _ITEMSIZES[spec[0]], spec[1])
                 for spec in layout)


def _numpy_dtype(x: Tensor) -> str:
    return _NUMPY_NAMES[x.dtype]


_NUMPY_NAMES = {dtype: torch.empty(0, dtype=dtype).numpy().dtype.str
                for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64,
                              torch.float32, torch.float16)}
"""The tensors' dtypes :func:`send` takes (those :func:`capg_rec.logs.schema._reduce_for_processes` passes)."""
_TORCH_DTYPES = {name: dtype for dtype, name in _NUMPY_NAMES.items()}
_ITEMSIZES = {name: dtype.itemsize for dtype, name in _NUMPY_NAMES.items()}


def _stamp(view: mmap.mmap, start: int) -> int:
    return int.from_bytes(view[start:start + 8], "little")


def _open(name: str, size: int) -> tuple[mmap.mmap, socket.socket]:
    """Map a pool first seen here and unlink its file (this process holds it now), with a socket of its own for its
    tokens (datagrams not yet read count against the sending socket: a worker that reads none could fill a shared one),
    after closing those of pools whose workers have exited."""
    _sweep()
    _sweep_files(keep=name)  # not the one being read: its batch is whole, whether or not its worker still runs
    path = os.path.join(_SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise RuntimeError(f"a batch handed over by a DataLoader worker lies in {name}, which no longer exists: it "
                           "was read by another process, or after its worker exited (batches pickled in a DataLoader "
                           "worker are for its DataLoader)") from None
    try:
        view = mmap.mmap(fd, size * _SLOTS)
    finally:
        os.close(fd)
    os.unlink(path)
    reply = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    reply.setblocking(False)
    _maps[name] = view, reply
    return view, reply


def sweep() -> None:
    """Close the mappings of pools whose workers have exited (their unread slots' space goes back to ``/dev/shm``),
    at most once every :data:`_SWEEP_SECONDS`: called at each read of a batch, in-band ones too, since a full
    ``/dev/shm`` lets no new pool be made, whose first read would otherwise be the next chance."""
    if _maps and time.monotonic() >= _swept + _SWEEP_SECONDS:
        with _lock:
            _sweep()


def _sweep() -> None:
    global _swept
    _swept = time.monotonic()
    for old in [n for n in _maps if not _alive(n)]:
        for resource in _maps.pop(old):
            resource.close()


def _send_tokens() -> None:
    """Give the slots read back: a token that a worker's full queue refuses is kept for the next read (a slot lost
    would be lost for good); one whose worker is gone is dropped."""
    left = []
    for name, token in _unsent:
        if name not in _maps:
            continue
        try:
            _maps[name][1].sendto(token, "\0" + name)
        except BlockingIOError:
            left.append((name, token))
        except OSError:
            pass
    _unsent[:] = left


def _alive(name: str) -> bool:
    """Whether the worker that made a pool (its pid is in the name) is still running."""
    try:
        os.kill(int(name.split("-")[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took its pid: not ours, but alive
        pass
    return True
