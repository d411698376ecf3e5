"""Selective policies' replay (part of ``replay.StepReplay``): the outputs of the ops a policy saves,
and its ``checkpoint_name``d values, kept in the forward and handed back when a step is re-run.

Apart from the engine's forward and backward (``remat/replay.py``) because it is its own concern: what
a kept value is worth once the body wrote into it in place (``_mark_written``, ``_take``).
"""
import torch

from .. import _compat
from ..core.trees import ScanError
from . import policies, recipes
from .policy_ops import saves_op


def _map_tensors(fn, value):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


def leaves(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            leaves(v, out)
    elif isinstance(value, (tuple, list)):
        for v in value:
            leaves(v, out)
    return out


def versions_of(value):
    return tuple([t._version for t in leaves(value, [])])


class Replay(_compat.TorchDispatchMode):
    """Keeps (forward) or hands back (re-run) the outputs of the ops the policy saves."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.engine.dispatch(func, args, kwargs or {})


class SelectiveReplay:
    """The selective half of ``StepReplay``: ``kept``, ``replaying``, ``rpos``, ``pos``, ``offload``,
    ``policy``, ``decisions`` and ``mutable`` are the engine's."""

    def _saves(self, func):
        return saves_op(self.policy, func, self.decisions)

    def _keep(self, key, value, detach=True):
        """Keep ``value`` for the re-run. A kept alias of a value the body modifies in place later no
        longer holds what was kept: the re-run computes it instead (``_take``). A named value's alias
        shares its version counter (checked); an op's output is kept below autograd, where an alias
        does not: the in-place op marks it (``_mark_written``). Offloaded to the device it is on, it
        is an alias too."""
        device = self.offload
        if detach:
            value = _map_tensors(lambda t: t.detach() if device is None else t.detach().to(device, non_blocking=True),
                                 value)
        self.kept[self.pos].append((key, value, versions_of(value)))

    def _mark_written(self, func, args, kwargs):
        """An in-place op in a step's forward: the values kept so far that share its tensors' storage
        are stale."""
        mutable = self.mutable.get(func)
        if mutable is None:
            schema = _compat.op_schema(func) if _compat.is_op_overload(func) else None
            mutable = self.mutable[func] = schema is not None and schema.is_mutable
        if not mutable:
            return
        written = {recipes.storage_key(t) for t in leaves((args, kwargs), [])} - {0}
        kept = self.kept[self.pos]
        for i, (key, value, versions) in enumerate(kept):
            if any(recipes.storage_key(t) in written for t in leaves(value, [])):
                kept[i] = (key, value, _STALE)

    def _take(self, key, like_device):
        """What the forward kept for ``key``; None where the body modified it in place since (the
        re-run then computes it, as the forward did before modifying it)."""
        stored_key, value, versions = self.replaying[self.rpos]
        self.rpos += 1
        if stored_key != key:
            raise ScanError(f"scan: remat: a re-run step computed {key} where the forward saved {stored_key}; "
                            "the body must run the same ops when it is re-run in the backward.")
        if versions is _STALE or versions_of(value) != versions:
            return None
        return _map_tensors(lambda t: t.detach() if self.offload is None else t.to(like_device, non_blocking=True),
                            value)

    def dispatch(self, func, args, kwargs):
        saves = self._saves(func)
        if self.replaying is not None and saves:
            value = self._take(func, None if self.offload is None else _first_device(args))
            return func(*args, **kwargs) if value is None else value
        out = func(*args, **kwargs)
        if saves:
            self._keep(func, out)
        elif self.kept[self.pos]:
            self._mark_written(func, args, kwargs)
        return out

    def named(self, x, name):
        """``checkpoint_name`` inside a step: keep (forward) or hand back (re-run) ``x``."""
        if not self.policy.saves(policies.NAMED_VALUE, name):
            return x
        key = ("checkpoint_name", name)
        if self.replaying is not None:
            value = self._take(key, x.device)
            return x if value is None else value.requires_grad_(x.requires_grad)
        if self.hot is not None and self.hot.usable:  # recipes stop at x; if they stop serving in this
            self.hot.keep(x)  # step, its re-run takes x from ``kept`` (not detached here: under the
            self._keep(key, x, detach=False)  # recording mode that would be a call it records)
            return x
        self._keep(key, x)
        return x


_STALE = "stale"  # a kept value the body modified in place afterwards


def _first_device(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor):
                    return t.device
    return None
