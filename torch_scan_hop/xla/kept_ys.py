"""The While's stacked ys buffers kept from one step to the next (opt-in: ``SCAN_XLA_KEEP_YS=1``).

Every row of a stacked y is written before the While returns, so its initial value is never read;
but XLA's CPU backend has no uninitialized buffer, and a buffer in the step's program is one of
its temporaries, which PJRT allocates afresh for each execution. So each step fills every stacked
buffer (a layer stack's saved activations: 8 MB at depth 8 of benchmarks/xla_long.py) and, once
the program's temporaries pass glibc's largest mmap threshold (32 MB), page-faults every page of
them in again (13 000 faults a step at depth 32 there). Kept, a stacked buffer is a parameter of
the step's program updated in place (``buffer.copy_(y)``): torch_xla donates its device buffer to
the program, whose While then writes its rows there. No fill, no fresh pages: at depth 32 and 64 the
training step took 0.81-0.94x the time with them filled, at depth 8 0.96-1.04x (the 8 MB fill is
~1 ms of a ~33 ms step there; docs/benchmarks.md, ``xla_long.py --keep-ys``).

Why opt-in: the kept buffers stay allocated between steps (a training step's saved activations,
held until the next step instead of freed after the backward), and the benefit needs
``torch_xla.sync()`` (or ``mark_step``) every step: a buffer is taken by at most one scan between
two syncs (the step closure frees it) and a scan finding every buffer of its shape taken fills its
own as before, so a program without syncs does not chain one call's value into the next. Off under
SPMD, tracing (Dynamo, make_fx) and torch.compile, where a step's program is not this eager one.
A y the caller still holds at the next sync shares its device buffer with the kept one, which
torch_xla then does not donate (XLA copies it into the While: slower than a fill, same values).
A program that takes a donated buffer makes torch_xla's sync wait for it to finish (as one with
an optimizer's in-place updates already does). ``clear()`` lets every kept buffer go.
"""
import math
import os

import torch

from .. import _compat
from . import own_buffers

ENV = "SCAN_XLA_KEEP_YS"  # "1": stacked ys buffers kept between steps
MIN_BYTES = 1 << 20  # smaller buffers are filled: the in-place update's host cost is about a small fill's
PER_SHAPE = 2  # buffers kept per (shape, dtype, device): a training step's forward and backward may share one

_pools = {}  # (shape, dtype, device) -> [_Kept, ...]


class _Kept:
    """One kept buffer, and whether a scan took it since the last sync."""

    def __init__(self, tensor):
        self.tensor, self.taken = tensor, False


def enabled():
    return os.environ.get(ENV) == "1"


def applies(device):
    """Are stacked ys kept for a scan now (the option on, an eager lazy-tensor call)?"""
    return (enabled() and device.type == "xla" and not _compat.xla.spmd_active()
            and not _compat.dispatch_modes_active() and not _compat.is_dynamo_compiling()
            and not _compat.xla.in_openxla_bridge())


def initial_ys(y_meta, length, device, fill):
    """Each stacked y's initial buffer, and the kept entry it came from (None: a fill).
    ``fill(k, dtype)`` is the value a filled buffer starts with (``lower._fill``)."""
    ys, kept = [], []
    keep = applies(device)
    for k, (shape, dtype) in enumerate(y_meta):
        full = (length, *shape)
        entry = _take(full, dtype, device, fill(k, dtype)) if keep and _bytes(full, dtype) >= MIN_BYTES else None
        ys.append(entry.tensor if entry else own_buffers.filled(fill(k, dtype), dtype, device, full))
        kept.append(entry)
    return ys, kept


def keep_final(kept, ys):
    """The While's final ys become their kept buffers' values (in place: torch_xla donates the
    buffer at the sync, and the program writes them there)."""
    with torch.no_grad():
        for entry, y in zip(kept, ys):
            if entry is not None:
                entry.tensor.copy_(y)


def _bytes(shape, dtype):
    return math.prod(shape) * dtype.itemsize


def _take(shape, dtype, device, value):
    """A kept buffer of this shape no scan took since the last sync, or None (all taken)."""
    pool = _pools.setdefault((shape, dtype, str(device)), [])
    entry = next((e for e in pool if not e.taken), None)
    if entry is None and len(pool) < PER_SHAPE:
        entry = _Kept(own_buffers.filled(value, dtype, device, shape))  # its first program fills it
        pool.append(entry)
    if entry is None:
        return None
    if not any(e.taken for p in _pools.values() for e in p):
        _compat.xla.on_next_sync(_free_all)
    entry.taken = True
    return entry


def clear():
    """Let the kept buffers go (their memory returns once no program holds them)."""
    _pools.clear()


def _free_all():
    for pool in _pools.values():
        for entry in pool:
            entry.taken = False
