"""A traced body that writes into a tensor it closes over (``cache[t] = h``, ``cache`` captured,
not carried): the tensor is carried instead.

The loop writes into the caller's tensor step by step; a traced scan cannot write into one of its
inputs. ``scan`` (the make_fx path) finds such writes in the body's graph (``ClosureWrites``) and
runs the scan again with each written closure as one more carry (its value at the start as
``init``): the body reads and writes the carry wherever it names the closure
(``ClosureSubstitution``), the writes into the carry become its new value (``FlatBody.copy_carry``),
and after the scan the final value is copied into the caller's tensor, which then holds what the
loop leaves in it.
"""
import functools

import torch
from torch.overrides import TorchFunctionMode

from .. import _compat


class ClosureWrites(Exception):
    """The traced body writes into these closed-over tensors (the user's own, in order)."""

    def __init__(self, tensors):
        super().__init__(f"the body writes into {len(tensors)} closed-over tensor(s)")
        self.tensors = tensors


class ClosureSubstitution(TorchFunctionMode):
    """Every torch call of the body sees ``carried[k]`` where it names ``closures[k]``.

    A scan nested in the body (``remat="sqrt"``'s blocks, a scan in a scan) traces its own body
    with its modes above this one: they see the closure's name before this mode swaps it, and
    ask ``carried_by_an_enclosing_scan`` what it is."""

    def __init__(self, closures, carried):
        super().__init__()
        self.by_id = {id(c): v for c, v in zip(closures, carried)}
        self.closures = closures  # kept alive: ids are keys

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        swap = lambda t: self.by_id.get(id(t), t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        args, kwargs = _compat.pytree.tree_map(swap, (args, kwargs or {}))
        return func(*args, **kwargs)


_active = []  # the substitutions in force (one per scan carrying closures, outermost first)


def carried_by_an_enclosing_scan(t):
    """Does a scan whose body is running (being traced) carry the closed-over ``t``?"""
    return any(id(t) in s.by_id for s in _active)


def carries_closures(fn):
    """Is ``fn`` a body ``closures_carried`` made (its closures already carried)?"""
    return isinstance(fn, functools.partial) and fn.func is _with_closures_carried


def _with_closures_carried(fn, closures, carry, x):
    inner, carried = carry
    with ClosureSubstitution(closures, carried):
        new_inner, y = fn(inner, x)
    return (new_inner, list(carried)), y


def closures_carried(fn, closures):
    """``fn2((carry, carried), x)``: ``fn(carry, x)`` on the carried values of ``closures``."""
    return functools.partial(_with_closures_carried, fn, list(closures))
