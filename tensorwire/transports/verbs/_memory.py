"""Registered memory for the verbs transport: a cache of memory regions keyed by region.

Registering pins pages and costs a system call, so the buffers a peer reads from (a sender's
tensors) and the buffers RDMA READs land in (a recv's ``out=``) are registered once and found
again by address: an entry covers ``[address, address + length)`` with some access rights and
serves any later use inside that range with no more than those rights.

A registration pins the *physical* pages behind a virtual range. If the memory were freed and
the range reused, a cached registration would still point at the old pages, so every cached
entry is tied to the object that owns the memory (the root of a numpy array's ``base`` chain)
through a weak reference: when the owner dies, its entries are deregistered. That holds only
for owners whose memory stays where it is for as long as they live (``_keeps_memory``): a
numpy array that owns its memory (numpy refuses to resize one that is weakly referenced) and a
memoryview (its exporter cannot resize while it lives); a torch tensor's owner is its storage,
which torch makes unresizable once numpy has a view of it. Any other owner (an ``mmap``, an
``array.array``: ``np.ndarray(buffer=...)``, ``np.memmap``) can give its pages back and take new
ones at the same addresses once no array is left over it, and memory whose owner cannot be
weakly referenced has no end to watch: both are registered for one use only. The cache is
bounded (entries and pinned bytes); the least recently used idle entries go first, and a
registration refused with ENOMEM evicts every idle entry and tries once more before it fails
with RegistrationError.

Registering memory that RDMA writes into faults in every page of it that was never written
(a recv's new buffer, an ``out=`` fresh from ``np.empty``), and ``ibv_reg_mr`` does that while
holding the GIL. ``fault_in`` does it first, in a worker thread, without changing a byte
(``present`` says whether a range needs it; ``may_pin`` whether registering it now would fail
at once for the memlock limit).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import resource
import sys
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ._verbs import errno_of, pv, registration_error

log = logging.getLogger(__name__)

__all__ = [
    "FAULT_IN_BYTES",
    "MemoryCache",
    "Region",
    "fault_in",
    "fault_in_span",
    "may_pin",
    "owner_of",
    "present",
    "ring_buffer",
]

_MAX_ENTRIES = 512
_MAX_BYTES = 8 << 30
# memory this large, not registered yet, is faulted in by a worker thread before it is
# registered; below it the hop costs more than the faults
FAULT_IN_BYTES = 1 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_libc: Any = None
_GONE = object()


def fault_in(arrays: list[np.ndarray]) -> None:
    """Fault in every page of ``arrays`` for writing, not changing a byte (``madvise`` with
    MADV_POPULATE_WRITE), so that registering them after this only pins pages that are there.

    For a worker thread: ctypes lets go of the GIL around the call. Measured in the Soft-RoCE
    guest (emulated), registering 256 MiB that was never written took 3.5 s inside ``ibv_reg_mr``,
    all of it on the event loop, and 21 ms once faulted in. Never raises: where the kernel
    refuses (older than 5.14, memory it cannot populate), the registration faults the pages in
    itself, as it would have."""
    for a in arrays:
        fault_in_span(int(a.__array_interface__["data"][0]), a.nbytes)


def fault_in_span(address: int, length: int, keep: object = None) -> None:
    """``fault_in`` for the ``length`` bytes at ``address``; ``keep`` (what owns them) stays
    referenced meanwhile, so that the memory is not freed under the call."""
    try:
        start = address & ~(mmap.PAGESIZE - 1)
        if _c().madvise(start, address + length - start, _MADV_POPULATE_WRITE) != 0:
            log.debug("could not fault in %d bytes at %#x: errno %d", length, address, ctypes.get_errno())
    except Exception as exc:  # (no libc to be found by ctypes, say)
        log.debug("could not fault memory in before registering it: %s", exc)
    del keep


def present(address: int, length: int) -> bool:
    """Whether every page of the ``length`` bytes at ``address`` is in memory (``mincore``): then
    registering them faults nothing in. False where that cannot be told."""
    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    vec = np.zeros((address + length - start + page - 1) // page, np.uint8)
    try:
        if _c().mincore(start, address + length - start, vec.ctypes.data) != 0:
            return False
    except Exception:  # (no libc to be found by ctypes, say)
        return False
    return bool(np.all(vec & 1))


def may_pin(length: int) -> bool:
    """Whether pinning ``length`` bytes more stays within RLIMIT_MEMLOCK, counting what this
    process pins already (``VmPin``), as ``ibv_reg_mr`` checks before it pins a page; True where
    the limit does not apply (unlimited, or CAP_IPC_LOCK) or cannot be read."""
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if soft == resource.RLIM_INFINITY:
        return True
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        if int(fields["CapEff"].strip(), 16) >> 14 & 1:  # CAP_IPC_LOCK
            return True
        pinned = int(fields.get("VmPin", "0 kB").split()[0]) << 10
    except (OSError, KeyError, ValueError):
        return True
    return pinned + length + mmap.PAGESIZE <= soft


def _c() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
        _libc = libc
    return _libc


def owner_of(arr: np.ndarray) -> Any:
    """The object that owns ``arr``'s memory: the end of its ``base`` chain, or, where that is a
    torch tensor, its storage. (``t.numpy()`` makes a new alias tensor for its ``base`` each
    time: taken for the owner, it died with each message, and a tensor sent again was
    registered again, every time.)"""
    obj: Any = arr
    while isinstance(obj, np.ndarray) and obj.base is not None:
        obj = obj.base
    torch = sys.modules.get("torch")  # (none can be the base before torch is imported)
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.untyped_storage()  # the same object for as long as the storage lives
    return obj


def _keeps_memory(owner: object) -> bool:
    """Whether ``owner``'s memory stays at the same pages for as long as it lives, so that a
    registration of it may be cached until it dies (module docstring). An mmap resized to half
    and back while no array was over it kept its address and took new pages for the tail, and a
    cached registration went on sending the old ones (``tests/verbs``:
    ``test_memory_its_owner_moved_is_not_sent_from_a_stale_registration``)."""
    if isinstance(owner, np.ndarray):
        return bool(owner.flags.owndata)  # (one that does not own its memory cannot say when it goes)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(owner, torch.UntypedStorage):
        return not owner.resizable()  # (torch makes it so once numpy has a view of it)
    return isinstance(owner, memoryview)


class Region:
    """One memory registration (an ``ibv_mr``) and who is using it."""

    __slots__ = ("__weakref__", "access", "address", "cached", "length", "lkey", "mr", "rkey", "root", "uses")

    def __init__(self, mr: Any, address: int, length: int, access: int, root: int, cached: bool) -> None:
        self.mr = mr
        self.address = address
        self.length = length
        self.access = access
        self.lkey: int = mr.lkey
        self.rkey: int = mr.rkey
        self.root = root
        self.cached = cached
        self.uses = 0

    def covers(self, address: int, length: int, access: int) -> bool:
        return (
            self.address <= address
            and address + length <= self.address + self.length
            and (self.access & access) == access
        )

    def close(self) -> None:
        mr, self.mr = self.mr, None
        if mr is not None:
            try:
                mr.close()
            except Exception as exc:
                log.warning("deregistering %d bytes at %#x failed: %s", self.length, self.address, exc)


class MemoryCache:
    """Registrations of one protection domain, cached per memory owner (module docstring)."""

    def __init__(self, pd: Any, *, max_entries: int = _MAX_ENTRIES, max_bytes: int = _MAX_BYTES) -> None:
        self._pd = pd
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._by_root: dict[int, list[Region]] = {}
        self._lru: OrderedDict[Region, None] = OrderedDict()
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self.pinned = 0
        self.registrations = 0  # calls to ibv_reg_mr
        self.hits = 0
        self._closed = False

    def __len__(self) -> int:
        return len(self._lru)

    def cached(self, arr: np.ndarray, access: int) -> bool:
        """Whether a registration of ``arr`` with ``access`` is cached (``acquire`` would find it)."""
        address = int(arr.__array_interface__["data"][0])
        length = int(arr.nbytes)
        return any(
            r.mr is not None and r.covers(address, length, access) for r in self._by_root.get(id(owner_of(arr)), ())
        )

    def acquire(self, arr: np.ndarray, access: int) -> Region:
        """A registration covering ``arr`` (C-contiguous) with ``access``; ``release`` it after use."""
        address = int(arr.__array_interface__["data"][0])
        length = int(arr.nbytes)
        owner = owner_of(arr)
        root = id(owner)
        for region in self._by_root.get(root, ()):
            if region.mr is not None and region.covers(address, length, access):
                self.hits += 1
                region.uses += 1
                self._lru.move_to_end(region)
                return region
        cached = _keeps_memory(owner)  # (else its pages may change under a registration: this use only)
        if cached and root not in self._finalizers:
            try:
                self._finalizers[root] = weakref.finalize(owner, self._owner_died, root)
            except TypeError:
                cached = False  # cannot tell when it dies: register for this use only
        region = Region(self._register(address, length, access), address, length, access, root, cached)
        region.uses = 1
        if cached:
            self._by_root.setdefault(root, []).append(region)
            self._lru[region] = None
            self.pinned += length
            self._trim()
        return region

    def release(self, region: Region) -> None:
        region.uses -= 1
        if region.uses <= 0 and not region.cached:
            region.close()

    def _register(self, address: int, length: int, access: int) -> Any:
        verbs = pv()
        self.registrations += 1
        try:
            return verbs.mr.MR(self._pd, length, access, address=address)
        except verbs.pyverbs_error.PyverbsError as exc:
            if errno_of(exc) is None or not self._lru:
                raise registration_error(exc, length) from exc
            first = exc
        self._evict(everything=True)  # ENOMEM and the like: free what is idle, try once more
        try:
            return verbs.mr.MR(self._pd, length, access, address=address)
        except verbs.pyverbs_error.PyverbsError as exc:
            raise registration_error(exc, length) from first

    def _trim(self) -> None:
        if len(self._lru) > self._max_entries or self.pinned > self._max_bytes:
            self._evict(everything=False)

    def _evict(self, *, everything: bool) -> None:
        for region in list(self._lru):
            if not everything and len(self._lru) <= self._max_entries and self.pinned <= self._max_bytes:
                return
            if region.uses == 0:
                self._drop(region)

    def _drop(self, region: Region) -> None:
        if self._lru.pop(region, _GONE) is _GONE:
            # (its owner died since the caller listed it: ``_owner_died`` ran in a collection
            # inside deregistering another, and dropped it and its bytes already)
            return
        regions = self._by_root.get(region.root)
        if regions is not None and region in regions:
            regions.remove(region)
            if not regions:
                del self._by_root[region.root]
                fin = self._finalizers.pop(region.root, None)
                if fin is not None:
                    fin.detach()
        self.pinned -= region.length
        region.close()

    def _owner_died(self, root: int) -> None:
        """The finalizer of a cached owner: it runs wherever the owner dies, which may be inside
        this cache's own calls (a garbage collection in ``_evict``): each entry goes once."""
        self._finalizers.pop(root, None)
        for region in self._by_root.pop(root, []):
            if self._lru.pop(region, _GONE) is not _GONE:
                self.pinned -= region.length
            region.close()

    def close(self) -> None:
        """Deregister everything (the protection domain is going away)."""
        if self._closed:
            return
        self._closed = True
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        for region in list(self._lru):
            region.close()
        self._lru.clear()
        self._by_root.clear()
        self.pinned = 0


def ring_buffer(pd: Any, nbytes: int, access: int) -> tuple[Any, np.ndarray]:
    """A buffer pyverbs allocates and registers, with a numpy view of its bytes."""
    verbs = pv()
    try:
        mr = verbs.mr.MR(pd, nbytes, access)
    except verbs.pyverbs_error.PyverbsError as exc:
        raise registration_error(exc, nbytes, "ring buffer") from exc
    view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(mr.buf))
    return mr, view
