"""Which recorded torch function calls an op-level ``RematPolicy`` keeps the outputs of.

A policy is a function of aten ops (``dots_saveable`` saves ``aten.mm``,
``aten.addmm``, ...), while eager recipes (``remat/recipes.py``) are recorded a
level up, per torch function (``F.linear``, ``torch.tanh``), where a recording
mode costs a third of a dispatch mode per call. What a function runs below
autograd depends on the function and on its arguments' kinds (``F.linear``
of a matrix with a bias is one ``addmm``; of a 3-d input a ``mm`` and views;
``torch.matmul`` of a vector is an ``mv``), not on their values. So the first
call of a function with a given argument signature (tensor ranks, dtypes,
devices, contiguity; other arguments by type) runs under a dispatch mode that
lists the ops it runs, and the answer is kept per policy and signature: the
call's output is kept when the policy saves one of those ops (not a view or
an in-place op, as the dispatch path decides). Every later call with that
signature costs a dictionary lookup. Keeping the function's output rather than
the op's is the same bytes when the op makes the output (``addmm``, or ``mm``
and a view of it); when a cheap op follows it inside the function (a bias
added after a ``mm``), the output is kept in its place: the backward then
recomputes neither.
"""
import torch

from .. import _compat

_DECISIONS = {}  # policy.save -> {(function, signature): keep its output}: a training loop's scans probe once


def saves_op(policy, op, cache):
    """Does ``policy`` keep the output of aten op ``op`` (never a view's or an in-place op's)."""
    saves = cache.get(op)
    if saves is None:
        schema = _compat.op_schema(op) if _compat.is_op_overload(op) else None
        saves = schema is not None and not op.is_view and not schema.is_mutable and policy.saves(op, None)
        cache[op] = saves
    return saves


class _Ops(_compat.TorchDispatchMode):
    """Lists the aten ops a call runs (below autograd), running them as they are."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _signature(args):
    """The kinds of a call's arguments that choose what it runs: tensors by rank, dtype, device class
    and contiguity (~0.7 us each), anything else by its type."""
    return tuple([(a.dim(), a.dtype, a.is_cpu, a.is_contiguous()) if isinstance(a, torch.Tensor) else _kind(a)
                  for a in args])


def _kind(value):
    if isinstance(value, (tuple, list)):
        return _signature(value)
    if isinstance(value, dict):
        return tuple([(k, _kind(v)) for k, v in value.items()])
    return type(value)


class OpKeeps:
    """One engine's op-level policy, asked per recorded call: ``call(func, args, kwargs) -> (out, keep)``."""

    def __init__(self, policy):
        self.policy, self.by_op = policy, {}
        self.decisions = _shared(policy.save)

    def call(self, func, args, kwargs):
        key = (func, _signature(args), _kind(kwargs) if kwargs else None)
        keep = self.decisions.get(key)
        if keep is not None:
            return func(*args, **kwargs), keep
        mode = _Ops()
        with mode:
            out = func(*args, **kwargs)
        keep = self.decisions[key] = any(saves_op(self.policy, op, self.by_op) for op in mode.ops)
        return out, keep


def _shared(save):
    """The decisions of every scan with this ``save`` (a new dict for one that cannot be a key)."""
    try:
        decisions = _DECISIONS.get(save)
    except TypeError:  # an unhashable callable object
        return {}
    if decisions is None:
        if len(_DECISIONS) >= 256:  # a new lambda per training step: do not grow without bound
            _DECISIONS.clear()
        decisions = _DECISIONS[save] = {}
    return decisions
