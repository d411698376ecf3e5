"""DTensors (``torch.distributed.tensor``, public API only) as the op sees them: a local
tensor plus a layout (mesh, placements, global shape and stride).

``layout_of`` / ``wrap`` take a DTensor apart and put it back together (``to_local`` /
``from_local``, both differentiable); ``sliced`` / ``stacked`` give the layout of one
step's slice along dim 0 and of the steps' values stacked along a new dim 0. Used by
the DTensor rule (``op.dtensor``), the examples a body is traced on, and the stacked
weights of ``scan_layers``.
"""
import torch

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor = Partial = Replicate = Shard = None


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def layout_of(t):
    """``(mesh, placements, global shape, global stride)`` of a DTensor."""
    return (t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride()))


def wrap(local, layout):
    """The DTensor with this local tensor and layout (no communication)."""
    mesh, placements, shape, stride = layout
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def local(t):
    """A DTensor's local tensor (differentiable); anything else unchanged."""
    return t.to_local() if is_dtensor(t) else t


def unbind(x):
    """``x.unbind(0)``; a DTensor's rows one ``select`` each (DTensor has no unbind rule)."""
    if is_dtensor(x):
        return [x.select(0, i) for i in range(x.shape[0])]
    return x.unbind(0)


def _shard_dim(p):
    return p.dim if isinstance(p, Shard) else None


def _shift(p, k):
    split = getattr(p, "split_factor", None)  # _StridedShard (FSDP + TP); not type(p): Dynamo
    return Shard(p.dim + k) if split is None else type(p)(p.dim + k, split_factor=split)


def contiguous_stride(shape):
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc = acc * size
    return tuple(reversed(stride))


def sliced(layout):
    """The layout of one slice along dim 0; a placement sharding dim 0 becomes Replicate
    (``unsharded_along_scan`` gathers it first). (Loops, not generator expressions:
    Dynamo inlines these.)"""
    mesh, placements, shape, _ = layout
    out = []
    for p in placements:
        out.append(Replicate() if _shard_dim(p) == 0 else _shift(p, -1) if isinstance(p, Shard) else p)
    return (mesh, tuple(out), shape[1:], contiguous_stride(shape[1:]))


def stacked(layout, length):
    """The layout of ``length`` values of this layout stacked along a new dim 0."""
    mesh, placements, shape, _ = layout
    shape = (length, *shape)
    out = []
    for p in placements:
        out.append(_shift(p, 1) if isinstance(p, Shard) else p)
    return (mesh, tuple(out), shape, contiguous_stride(shape))


def unsharded_along_scan(x):
    """``x`` with dim 0 (the scanned one) whole on every rank: each rank runs every step."""
    if not any(_shard_dim(p) == 0 for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [Replicate() if _shard_dim(p) == 0 else p for p in x.placements])


def zero_slice(x):
    """A DTensor of zeros laid out as one slice of ``x`` along dim 0 (exists for length 0 too)."""
    loc = x.to_local()  # slicing dim 0 leaves the other dims' local sizes as they are
    return wrap(torch.zeros(loc.shape[1:], dtype=x.dtype, device=loc.device), sliced(layout_of(x)))


def gathered(t):
    """A DTensor's full value as a plain tensor, gathered on every rank, whose gradient is
    averaged over the mesh and handed back in ``t``'s layout (reduce-scattered along a
    sharded mesh dim): FSDP2's unshard of a parameter and the reduction of its gradient."""
    n = t.device_mesh.ndim
    return t.redistribute(t.device_mesh, [Replicate()] * n).to_local(grad_placements=[Partial("avg")] * n)


def describe(t):
    if is_dtensor(t):
        return f"a DTensor with placements {tuple(t.placements)} on {t.device_mesh}"
    return "a torch.Tensor" if isinstance(t, torch.Tensor) else repr(t)
