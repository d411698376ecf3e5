"""Selective checkpointing whose saved values can be backwarded through more than once.

torch's ``create_selective_checkpoint_contexts`` consumes each saved value as the backward
uses it; a scan_layers step checkpointed selectively (``remat.step``) must replay them, as the
loop's own tape can (``retain_graph``, gradcheck). torch 2.9 keeps a list per op, 2.14 on an
indexed dict; the storage's default factory tells which.
"""
from torch.utils import checkpoint as _ckpt

from .. import _compat


class _ReplayList(list):
    """torch 2.9's SAC storage: a list per op that the backward ``pop(0)``s.
    Replaying instead of consuming lets a step checkpointed selectively be
    backwarded more than once, as the loop's own tape can (retain_graph,
    gradcheck); positions restart at each recompute."""

    pos = 0

    def pop(self, index=-1):
        item = self[self.pos]
        self.pos += 1
        return item


class _ReplayDict(dict):
    """Newer torch's SAC storage (2.14): ``{call index: saved}`` per op, an entry
    marked consumed (``_compat.autograd.checkpoint_consumed_marker()``) once used. Keeping the entry
    allows a second backward."""

    def __setitem__(self, key, value):
        if key in self and value is _compat.autograd.checkpoint_consumed_marker():
            return
        super().__setitem__(key, value)


def replayable_selective_checkpoint_contexts(policy_fn):
    """torch's ``create_selective_checkpoint_contexts`` with replaying storage.

    The storage's default factory tells the layouts apart: ``dict`` is torch
    2.14's indexed storage (``_ReplayDict``), ``list`` torch 2.9's (``_ReplayList``,
    and a cached-context subclass that resets positions per recompute).
    """
    caching, cached = _ckpt.create_selective_checkpoint_contexts(policy_fn)
    storage = caching.storage
    if storage.default_factory is dict:  # newer torch: indexed entries
        storage.default_factory = _ReplayDict
        return caching, cached

    class Replaying(type(cached)):  # torch 2.9: lists, positions reset per recompute
        def __enter__(self):
            for saved in self.storage.values():
                saved.pos = 0
            return super().__enter__()

    storage.default_factory = _ReplayList
    return caching, Replaying(policy_fn, storage, False)
