"""XLA SPMD: a scan's gradients keep the shardings of the tensors they are
gradients of, as torch_xla's own scan does (its ``shard_as``).

Inside the backward While, GSPMD propagates shardings from the body's
annotations, and a gradient accumulated in a carry (a closure's, a weight's)
can come out of the loop replicated. The backward rule records each input's
sharding (``of``) and gives it to the matching gradient, and to the zeros its
accumulator starts from (``like``), so a weight sharded ("fsdp", "tensor")
gets a gradient sharded ("fsdp", "tensor"). Off SPMD nothing is sharded and
both are no-ops.
"""
import sys

import torch

from .. import _compat


def _spmd_tensor(t):
    """A real XLA tensor (torch_xla's own functional wrapper included), no
    tracer or transform about: under make_fx, Dynamo, AOT or torch.func the
    annotation could not be recorded, so none is made."""
    return _recordable() and _real_xla(t)


def _recordable():
    return "torch_xla" in sys.modules and _compat.xla.spmd_active() and not _compat.dispatch_modes_active() \
        and not _compat.functorch_transforms_active()


def _real_xla(t):
    return isinstance(t, torch.Tensor) and t.device.type == "xla" and _compat.is_concrete(t) \
        and not isinstance(t, _compat.FunctionalTensor)


def of(tensors):
    """Each tensor's OpSharding, None where it has none (or is not an XLA tensor).
    The tracer checks are made once for all: ``scan_layers`` asks this of every
    layer's weight on every call."""
    if not _recordable():
        return [None] * len(tensors)
    return [_compat.xla.op_sharding(t) if _real_xla(t) else None for t in tensors]


def like(tensor, sharding):
    """``tensor`` annotated with ``sharding`` (as it is where sharding is None)."""
    if tensor is None or sharding is None or not _spmd_tensor(tensor):
        return tensor
    return _compat.xla.with_op_sharding(tensor, sharding)
