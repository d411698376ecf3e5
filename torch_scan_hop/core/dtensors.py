"""DTensors (``torch.distributed.tensor``, public API only) as the op sees them: a local
tensor plus a layout (mesh, placements, global shape and stride).

``layout_of`` / ``wrap`` take a DTensor apart and put it back together (``to_local`` /
``from_local``, both differentiable); ``sliced`` / ``stacked`` give the layout of one
step's slice along dim 0 and of the steps' values stacked along a new dim 0;
``gathered`` / ``gathered_together`` are FSDP2's unshard of one or all of a layer's
parameters (their gradients averaged and reduce-scattered back). Used by the DTensor
rule (``op.dtensor``), the examples a body is traced on, the eager loop's slices and
stacked ys, and ``scan_layers``' stacked weights over FSDP2 layers.
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


def symbolic_entries(layouts):
    """The symbolic sizes and strides (``torch.SymInt``: ``torch.compile`` with dynamic shapes)
    in these layouts' global shapes and strides, in order."""
    out = []
    for lay in layouts:
        if lay is not None:
            out += [v for v in (*lay[2], *lay[3]) if not isinstance(v, int)]
    return out


def size_carrier(entries, like):
    """A tensor with no elements whose dims 1.. are ``entries``. A body traced inside a
    traced scan can use the outer trace's symbolic sizes only through its own inputs (a
    size computed outside is not tracked there, even one that Dynamo has since specialized
    to a constant, as a sharded dim marked static under ``dynamic=True``), so the layouts'
    sizes travel in this one's shape."""
    return torch.empty((0, *entries), dtype=torch.uint8, device=like.device)


def first_tensor(values):
    return next(v for v in values if isinstance(v, torch.Tensor))


def with_entries(layouts, carrier):
    """``layouts`` with their symbolic entries, in ``symbolic_entries``' order, read from
    ``carrier``'s shape instead (inside the body's trace: tracked there)."""
    values = iter(carrier.shape[1:])
    out = []
    for lay in layouts:
        if lay is None:
            out.append(None)
            continue
        shape = tuple(v if isinstance(v, int) else next(values) for v in lay[2])
        stride = tuple(v if isinstance(v, int) else next(values) for v in lay[3])
        out.append((lay[0], lay[1], shape, stride))
    return out


def local(t):
    """A DTensor's local tensor (differentiable); anything else unchanged. Its gradient is
    taken as the global one wherever ``t`` is ``Partial`` (``_local_grad_placements``)."""
    return t.to_local(grad_placements=_local_grad_placements(t.placements)) if is_dtensor(t) else t


def _local_grad_placements(placements):
    """The layout of the gradient that flows back into the local tensor of a DTensor laid out
    by ``placements``: for a ``Partial`` one, each rank's piece gets the whole gradient (d sum /
    d piece = 1), a ``Replicate`` value; ``to_local``'s default (the DTensor's own placements)
    would call it a Partial piece again and count it once per rank. Shards stay shards.
    (Our wraps hand back the whole gradient too: ``from_local``'s backward keeps a Replicate
    gradient replicated.)"""
    out = []
    for p in placements:
        out.append(Replicate() if isinstance(p, Partial) else p)
    return tuple(out)


def unbind(x):
    """``x.unbind(0)``. A DTensor (which has no unbind rule) is gathered along dim 0 if sharded
    there, then its local tensor is unbound and each row wrapped in the slice's layout: the
    rows' gradients flow back through plain tensors. (Row by row with DTensor's ``select``,
    torch 2.9 got the gradient of xs wrong: 2 gloo ranks, Replicate xs, 3 rows, the Python loop
    too; right on torch 2.15.)"""
    if is_dtensor(x):
        x = unsharded_along_scan(x)
        layout = sliced(layout_of(x))
        return [wrap(row, layout) for row in local(x).unbind(0)]
    return x.unbind(0)


def sharded_dims(t):
    """The dims a DTensor is sharded along (over any mesh dim)."""
    return sorted({p.dim for p in t.placements if isinstance(p, Shard)})


def _shard_dim(p):
    return p.dim if isinstance(p, Shard) else None


def _constant_dim(p):
    """A Shard placement's dim as a Python int. Under ``torch.compile(dynamic=True)`` Dynamo
    reads the dim of an input's placement as a symbolic int, which a new placement cannot
    take; comparing it with constants specializes it (a guard per compiled graph)."""
    for d in range(64):
        if p.dim == d:
            return d
    return p.dim


def _shift(p, k):
    split = getattr(p, "split_factor", None)  # _StridedShard (FSDP + TP); not type(p): Dynamo
    dim = _constant_dim(p) + k
    return Shard(dim) if split is None else type(p)(dim, split_factor=split)


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


def stack_locals(ts, stack=None):
    """DTensors of one layout stacked along a new dim 0 from their local tensors (no
    communication): the result keeps their layout, a sharded dim shifted by the new one.
    ``stack`` stacks the locals (``torch.stack`` unless given)."""
    locals_ = [local(t) for t in ts]
    return wrap((stack or torch.stack)(locals_), stacked(layout_of(ts[0]), len(ts)))


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


def _one_shard_dim(t):
    """The mesh dim along which ``t`` shards its dim 0, when that is its only sharding
    (the rest Replicate: FSDP2's ``Shard(0)``, HSDP's ``(Replicate, Shard(0))``), else None."""
    shards = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    others = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
    if len(shards) != 1 or others or t.placements[shards[0]].dim != 0 or getattr(
            t.placements[shards[0]], "split_factor", None) is not None:
        return None
    return shards[0]


def local_shape(shape, placements, coordinate, sizes):
    """The local shape on the rank at ``coordinate`` of a mesh of ``sizes`` of a DTensor of
    global ``shape`` laid out by ``placements`` (``torch.chunk``'s sizes, as DTensor's)."""
    shape = list(shape)
    for p, c, m in zip(placements, coordinate, sizes):
        if isinstance(p, Shard):
            chunk = -(-shape[p.dim] // m)
            shape[p.dim] = max(0, min(chunk, shape[p.dim] - c * chunk))
    return tuple(shape)


def fsdp_part(t, fsdp_layout, tp_layout):
    """An FSDP2 + TP parameter seen along FSDP2's mesh only: its local shard as a DTensor of the
    tensor-parallel local tensor, sharded along dim 0 as FSDP2 shards it (``_StridedShard``
    along the full mesh is ``Shard(0)`` of the TP-local tensor), so that it is stacked, sliced
    and gathered as a plain FSDP2 parameter (Dynamo can neither build a DTensor whose
    placements hold a ``_StridedShard`` nor, from torch 2.11, read one); its gradient flows
    back in the parameter's own layout. ``fsdp_layout``: (FSDP2's mesh, its placements of a
    plain parameter); ``tp_layout``: (TP mesh, this rank's coordinate there, the mesh's sizes)."""
    fsdp_mesh, placements = fsdp_layout
    _, coordinate, sizes = tp_layout
    shape = local_shape(tuple(t.shape), tuple(t.placements)[fsdp_mesh.ndim:], coordinate, sizes)
    return wrap(t.to_local(), (fsdp_mesh, placements, shape, contiguous_stride(shape)))


def tensor_parallel_whole(local, tp_mesh, placements, shape):
    """A gathered TP-local tensor (``fsdp_part``) as the tensor-parallel DTensor FSDP2 hands
    the module: the TP mesh and placements, the parameter's global shape."""
    return wrap(local, (tp_mesh, placements, shape, contiguous_stride(shape)))


def gathered_together(ts):
    """``[gathered(t) for t in ts]`` with ONE all-gather (and one reduce-scatter of the
    gradients), as FSDP2 gathers a layer's parameters: the local shards, each padded to
    its even chunk of dim 0 and flattened, are concatenated into one buffer sharded along
    dim 0 like them. Falls back to one gather per tensor unless every tensor shards its
    dim 0 along the same single mesh dim of one mesh (the rest Replicate)."""
    mesh, placements = ts[0].device_mesh, tuple(ts[0].placements)
    mesh_dim = _one_shard_dim(ts[0])
    if mesh_dim is None or any(t.device_mesh != mesh or tuple(t.placements) != placements for t in ts):
        return [gathered(t) for t in ts]
    k = mesh.size(mesh_dim)
    pieces, metas = [], []
    for t in ts:
        rows, rest = t.shape[0], tuple(t.shape[1:])
        chunk, width = -(-rows // k), 1
        for size in rest:
            width *= size
        loc = t.to_local()
        flat = loc.reshape(loc.shape[0], width)
        if loc.shape[0] < chunk:  # torch.chunk's uneven last shards, padded as FSDP2 pads them
            flat = torch.nn.functional.pad(flat, (0, 0, 0, chunk - loc.shape[0]))
        pieces.append(flat.reshape(chunk * width))
        metas.append((rows, chunk, width, rest))
    buf = torch.cat(pieces)
    size = buf.shape[0]
    whole = DTensor.from_local(buf, mesh, placements, run_check=False, shape=torch.Size((k * size,)), stride=(1,))
    full = gathered(whole).view(k, size)
    out = []  # one split (its backward one cat), not a slice per tensor (a zero-filled buffer each)
    for (rows, chunk, width, rest), part in zip(metas, full.split([chunk * width for _, chunk, width, _ in metas], 1)):
        part = part.reshape(k * chunk, *rest)
        out.append(part if rows == k * chunk else part[:rows])
    return out


def describe(t):
    if is_dtensor(t):
        return f"a DTensor with placements {tuple(t.placements)} on {t.device_mesh}"
    return "a torch.Tensor" if isinstance(t, torch.Tensor) else repr(t)
