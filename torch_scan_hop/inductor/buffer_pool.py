"""Reused CPU storage for the stacked buffers of compiled scans.

A compiled scan preallocates one ``(L, ...)`` buffer per stacked output: its
ys, and in a training step every saved activation and every stacked weight
gradient. The for-loop it replaces allocates the same bytes as many small
per-layer tensors, which malloc recycles from its heap. One big buffer per
value is different: above glibc's mmap threshold (at most 32 MiB) every
allocation is a fresh mmap, and below it the heap top is trimmed back once
freed, so each training step page-faults its whole working set in again
(measured: 145,000 faults per step for a 64-layer decoder at batch 8x128,
15 for the compiled loop; ~7% of the step).

The inductor lowering therefore takes such buffers from this pool: storage
stays here between steps and is handed out again only when no tensor uses
it any more (its use count is 1: the pool's own reference). Buffers of other
devices (CUDA has its caching allocator) and small ones are plain
``empty_strided``. Idle storage is bounded by bytes: after a request no idle
storage fits (new shapes), the least recently used idle storage goes until
at most twice the largest single request stays idle. Changing shapes thus
do not pile up one working set each, while two working sets used in turn (a
training and an evaluation step of other shapes, two models) both stay:
releasing everything else on each miss made such pairs evict each other on
every call, page-faulting both in again. Storage per size (``_PER_KEY``) and
sizes (``_KEYS``) are bounded too; ``torch_scan_hop.empty_cache()`` releases
every idle buffer.
"""
import collections
import threading

import torch

from .. import _compat
from . import cpp_wrapper

_MIN_BYTES = 128 * 1024  # smaller blocks come from (and go back to) malloc's heap
_KEYS = 64  # distinct (bytes, device) sizes kept
_PER_KEY = 64  # storages kept per size (values of one size alive at once: q, k, v, ...)
_lock = threading.Lock()
_pool = collections.OrderedDict()  # (nbytes, device) -> [_Slot], oldest first
_IDLE_FACTOR = 2  # idle bytes kept: at most this many times the largest request
_largest_request = [0]  # pooled bytes of the largest single call so far (reset by empty_cache)
_epoch = [0]  # bumped whenever storage leaves the pool: a signature's last slots are then stale


def _span(size, stride):
    """Elements a tensor of these sizes/strides reaches (0 when empty)."""
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def stacked_buffer(size, stride, dtype, device):
    """An uninitialized tensor of ``size``/``stride``, on storage no live tensor uses."""
    entry = _entry(size, stride, dtype, device)
    return _buffers([entry], entry[0][0] if entry[0] else 0, dtype, device)[0]


def _unpooled(size, stride, dtype, device):
    """Whether a buffer of these static sizes/strides would be plain ``empty_strided`` anyway."""
    static = all(isinstance(v, int) for v in (*size, *stride))
    return static and _entry(size, stride, dtype, device)[0] is None


def _entry(size, stride, dtype, device):
    """``(pool key or None, size, stride)``: None for a buffer malloc serves well."""
    nbytes = _span(size, stride) * dtype.itemsize
    key = None if device.type != "cpu" or nbytes < _MIN_BYTES else (nbytes, device)
    return key, tuple(size), tuple(stride)


def _buffers(entries, request, dtype, device, last=None):
    """One tensor per entry; ``request`` is the entries' pooled bytes. ``last`` (a call
    signature's ``[epoch, slots]``) remembers the storage this signature got last time: a
    steady training step asks for the same buffers every call, and when all of them are idle
    again they are handed out without searching the pool."""
    with _lock:  # the check and the tensor taking the storage happen together
        slots = _same_as_last(last)
        if slots is not None:
            for key, _, _ in entries:
                if key is not None:
                    _pool.move_to_end(key)  # used now: trimmed last
        else:
            slots = _take(entries, request)
            if last is not None:
                last[:] = [_epoch[0], slots]
        return [_compat.empty_strided(size, stride, dtype, device) if slot is None else slot.tensor(size, stride, dtype)
                for slot, (_, size, stride) in zip(slots, entries)]


def _same_as_last(last):
    """``last``'s slots when they are all still pooled and idle, else None."""
    if last is None or last[0] != _epoch[0]:
        return None
    slots = last[1]
    for slot in slots:
        if slot is not None and not slot.idle():
            return None
    return slots


def _take(entries, request):
    """One slot (None: not pooled) per entry: idle ones first, new ones else."""
    if request > _largest_request[0]:
        _largest_request[0] = request
    out, missed, scanned = [], False, {}
    for key, _, _ in entries:
        if key is None:
            out.append(None)
        else:
            slot, new = _idle_or_new(key, scanned)
            missed |= new
            out.append(slot)
    if missed:  # this request's buffers count as idle too: they will be
        _trim_idle(_IDLE_FACTOR * _largest_request[0] - request)
    return out


class _Slot:
    """One pooled storage, and per dtype an empty tensor on it from which buffers are made
    (``_compat.alias_storage``: ~1 us, where a fresh ``empty(0).set_(storage)`` takes ~5 us;
    ~25 buffers a training step)."""
    __slots__ = ("storage", "bases")

    def __init__(self, nbytes, device):
        self.storage = torch.UntypedStorage(nbytes, device=device)
        self.bases = {}

    def idle(self):
        """No tensor but the pool's own (its storage object and bases) uses the storage."""
        return _compat.storage_use_count(self.storage) == 1 + len(self.bases)

    def tensor(self, size, stride, dtype):
        base = self.bases.get(dtype)
        if base is None:
            base = self.bases[dtype] = torch.empty(0, dtype=dtype, device=self.storage.device).set_(self.storage)
        return _compat.alias_storage(base, size, stride)


def _idle_or_new(key, scanned):
    """``(slot, made now)``: an idle slot of this size, else a new one. ``scanned[key]``:
    how many of this size's slots this request has already looked at (all busy or taken)."""
    entries = _pool.get(key)
    if entries is None:
        entries = _pool[key] = []
    elif key not in scanned:
        _pool.move_to_end(key)  # most recently used last
    for i in range(scanned.get(key, 0), len(entries)):
        if entries[i].idle():
            scanned[key] = i + 1
            return entries[i], False
    slot = _Slot(*key)
    entries.append(slot)
    if len(entries) > _PER_KEY:
        del entries[0]  # forgotten: freed now if idle, else when its tensors die
        _epoch[0] += 1
    scanned[key] = len(entries)
    while len(_pool) > _KEYS:
        _pool.popitem(last=False)
        _epoch[0] += 1
    return slot, True


def _trim_idle(limit):
    """Release idle storage, least recently used size first, until at most ``limit`` bytes are idle."""
    idle = [(key, slot) for key, entries in _pool.items() for slot in entries if slot.idle()]
    excess = sum(key[0] for key, _ in idle) - limit
    for key, slot in idle:  # oldest sizes first
        if excess <= 0:
            break
        kept = [s for s in _pool[key] if s is not slot]
        if kept:
            _pool[key] = kept
        else:
            del _pool[key]
        _epoch[0] += 1
        excess -= key[0]


def empty_cache():
    """Release the pool's idle buffers (buffers still in use are freed when their tensors die)."""
    with _lock:
        _pool.clear()
        _largest_request[0] = 0
        _epoch[0] += 1


def _pooled_bytes():
    """(idle, total) bytes held by the pool (for tests)."""
    with _lock:
        idle = total = 0
        for (nbytes, _), entries in _pool.items():
            for slot in entries:
                total += nbytes
                idle += nbytes if slot.idle() else 0
        return idle, total


_LIB = torch.library.Library("torch_scan_hop", "FRAGMENT")
_LIB.define("stacked_buffers(str layout, SymInt[] symbols, ScalarType dtype, Device device) -> Tensor[]",
            tags=(torch.Tag.pt2_compliant_tag,))


def _parse(layout, symbols):
    """``[(size, stride)]`` from ``layout``: ``"s,s,s/t,t,t;..."``, an entry ``$k`` standing
    for ``symbols[k]`` (a size the compiled graph only knows when called)."""
    def value(v):
        return symbols[int(v[1:])] if v[0] == "$" else int(v)

    shapes = []
    for buf in layout.split(";"):
        size, stride = buf.split("/")
        shapes.append(tuple(tuple(value(v) for v in part.split(",") if v) for part in (size, stride)))
    return shapes


def stacked_buffers_op(layout, symbols, dtype, device):
    """``stacked_buffer`` for several buffers of one dtype and device, in ONE operator call (a
    call from inductor's generated code costs ~60 us, so not one per buffer). Runs every step:
    the static sizes and strides travel as one string (a SymInt list costs ~0.4 us per int to
    pass), only the sizes known at run time as ``symbols``, and what does not change between
    calls (shapes, pool keys) is worked out once per signature. A plain library kernel
    (``custom_op``'s Python wrappers cost ~150 us a call)."""
    entries, request, last = _entries_of(layout, symbols, dtype, device)
    return _buffers(entries, request, dtype, device, last)


_LIB.impl("stacked_buffers", stacked_buffers_op, "CompositeExplicitAutograd")


@torch.library.register_fake("torch_scan_hop::stacked_buffers", lib=_LIB)
def _(layout, symbols, dtype, device):
    return [torch.empty_strided(size, stride, dtype=dtype, device=device) for size, stride in _parse(layout, symbols)]


_ENTRIES = {}  # call signature -> ([(pool key, size, stride)], pooled bytes, [epoch, last slots])


def _entries_of(layout, symbols, dtype, device):
    symbols = symbols or ()  # AOTInductor passes an empty list as None
    sig = (layout, *symbols, dtype, device)
    found = _ENTRIES.get(sig)
    if found is None:
        if len(_ENTRIES) >= 256:
            _ENTRIES.clear()
        entries = [_entry(size, stride, dtype, device) for size, stride in _parse(layout, symbols)]
        found = _ENTRIES[sig] = (entries, sum(key[0] for key, _, _ in entries if key is not None), [-1, None])
    return found


def stacked_buffers(shapes, dtype, device):
    """One pooled buffer per ``(size, stride)`` in ``shapes`` (ints or SymInts), through the operator.
    A C++ wrapper (AOTInductor) cannot call a Python operator, and a package must run
    without it: plain ``empty_strided`` there. So too where the pool would keep none of the
    buffers (static sizes, each small or not on the CPU): the operator call costs ~10x an
    ``empty_strided`` (measured on a loaded 2-core box: 140-200 us vs 12 us), about the
    whole gap between a 16-step RNN scan and the compiled loop."""
    if not shapes:
        return []
    if cpp_wrapper.cpp_wrapper_active() or all(_unpooled(size, stride, dtype, device) for size, stride in shapes):
        return [torch.empty_strided(size, stride, dtype=dtype, device=device) for size, stride in shapes]
    symbols = []

    def encode(v):
        if isinstance(v, int):
            return str(v)
        symbols.append(v)
        return f"${len(symbols) - 1}"

    layout = ";".join(",".join(map(encode, size)) + "/" + ",".join(map(encode, stride)) for size, stride in shapes)
    return torch.ops.torch_scan_hop.stacked_buffers(layout, symbols, dtype, device)
