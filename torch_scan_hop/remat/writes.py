"""Eager remat of a body that writes into tensors from outside the step (``cache[t] = h``, ``K.index_copy_``).

The replay engine (``remat/replay.py``) recomputes a step's saved values later: from recipes that
read the step's inputs in the backward, or by re-running the step (``sqrt``, binomial, random ops;
in the forward too, where the body wrote into a kept carry). A write into a closed-over tensor
breaks both: a re-run writes again (``buf[t] += row`` twice), and reads (recipes' or a re-run's)
see the contents later steps left, not those the step read. Making that replay correct would mean
keeping a copy of every such tensor per step, which is what remat is there to avoid; so such a scan
runs as the plain loop on the tape instead (no recompute), with one warning saying why, counted in
``counts()``. Writes into the carry (leaves, carried buffers) stay remat's: re-runs start from
copies of the kept carries, and recipes read copies taken before the write (``recipes.py``).

``Probe`` watches the first step, as a torch function mode, for in-place calls on a tensor that is
not its carry's nor made in the step; the engine keeps that step's saved values as they are until
the step ends, so it can still become a plain step. A later step that writes into one of the
outside tensors the first step read (the first did not) is a ScanError: its earlier steps were
already served by remat.
"""
import collections
import warnings

import torch

from ..core.trees import ScanError
from .recipes import Kept, storage_key

_COUNTS = collections.Counter()


def counts():
    """``{"plain": n}``: eager remat scans run as the plain loop since their body wrote in place into
    a tensor from outside the step."""
    return dict(_COUNTS)


class RematWritesWarning(UserWarning):
    """An eager scan's ``remat`` was not applied: its body writes into a tensor from outside the step."""


_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                               "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__",
                               "__ilshift__", "__irshift__"})


def _writes(func):
    """Does ``func`` (a torch function, by name: ``add_``, ``index_copy_``, ``__setitem__``, ``__iadd__``)
    write into its first argument?"""
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


def _tensors(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, out)
    return out


class Probe(torch.overrides.TorchFunctionMode):
    """The first step: which tensors from outside it (not its carry's, not made in it) it writes in
    place, told apart by storage (a view of a closed-over tensor writes into it), and which outside
    tensors it read (a later step's write into one is found by its version, ``check``)."""

    def __init__(self, carry):
        super().__init__()
        self.carry = {storage_key(t) for t in _tensors(carry, [])} - {0}
        self.made, self.read, self.written = set(), {}, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs), [])
        keys = [storage_key(t) for t in inputs]
        if _writes(func) and inputs:
            key = keys[0]
            if key not in self.made and key not in self.carry:
                self.written.append(inputs[0])
        for t, key in zip(inputs, keys):
            if key and key not in self.made and key not in self.carry and key not in self.read:
                self.read[key] = t
        out = func(*args, **kwargs)
        self.made.update(k for k in (storage_key(t) for t in _tensors(out, [])) if k and k not in keys)
        return out

    def versions(self):
        """The outside tensors the step read, with their versions after it."""
        return [(t, t._version) for t in self.read.values()]


def fall_back(written):
    _COUNTS["plain"] += 1
    t = written[0]
    warnings.warn(
        f"torch_scan_hop: scan's remat is not applied: the body writes in place into a tensor from outside the "
        f"step (a closed-over {tuple(t.shape)} {t.dtype} tensor, e.g. buf[t] = row), which recomputing a step "
        f"would write again and read with later steps' contents; the scan runs as the plain loop on the tape "
        f"(remat='save_all'). Carry the buffer instead (state = (carry, buf)) to keep remat.",
        RematWritesWarning, stacklevel=4)


def check(read, pos):
    """A later step wrote into an outside tensor the first step only read: refused (steps before it
    were served by remat, whose recompute would read the contents written since)."""
    for t, version in read:
        if t._version != version:
            raise ScanError(f"scan: remat: step {pos} wrote in place into a tensor from outside the step "
                            f"({tuple(t.shape)} {t.dtype}), which the first step did not write; remat cannot "
                            "recompute earlier steps from it. Write it at every step, carry it, or use "
                            "remat='save_all'.")


class Probed:
    """A value the first step saved: the engine's handle, and the tensor itself until the step ends
    (kept if the step turns out to write outside tensors: then it is a plain tape step)."""

    __slots__ = ("handle", "kept")

    def __init__(self, handle, t):
        self.handle, self.kept = handle, Kept(t)
