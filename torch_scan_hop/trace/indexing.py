"""A traced body indexing with a 0-d integer tensor: ``buf[:, t]`` and ``buf[:, t] = h``.

Python indexing reads a 0-d integer tensor index as a Python int (``t.item()``, then a
``select``): in a traced body that is a data-dependent read, which no graph of fixed shapes can
hold. A 0-d integer tensor used as an ADVANCED index gives the same shape (a 0-d index
broadcasts to no dims) and the same values, and traces: ``aten.index`` for a read,
``aten.index_put_`` for a write, both differentiable. ``TensorIndexRewrite`` makes that switch
while the body is traced, for indices whose tensors are all 0-d integer tensors (mixed with
ints, slices, None and Ellipsis); any other index goes to torch unchanged. The eager loop never
needs it (``t.item()`` is a real number there).
"""
import torch
from torch.overrides import TorchFunctionMode

from .. import _compat
from ..core.trees import ScanError
from . import stale_reads

_GET, _SET = torch.Tensor.__getitem__, torch.Tensor.__setitem__
_NOT_INDEX_DTYPES = (torch.bool, torch.uint8)  # masks, not positions


def _is_scalar_index(e):
    return (isinstance(e, torch.Tensor) and e.dim() == 0 and e.dtype not in _NOT_INDEX_DTYPES
            and not e.is_floating_point() and not e.is_complex())


def split_index(t, index):
    """``(basic, advanced)`` for an index of ``t`` holding 0-d integer tensors, else None.

    ``basic`` is the index with each such tensor replaced by ``slice(None)`` (a view of ``t``
    keeping that dim); ``advanced`` is the ``aten.index`` list over that view's dims, the 0-d
    tensors at the dims they index, None elsewhere."""
    index = index if isinstance(index, tuple) else (index,)
    if not any(_is_scalar_index(e) for e in index):
        return None
    if any(isinstance(e, torch.Tensor) and not _is_scalar_index(e) for e in index) \
            or any(isinstance(e, (list, bool)) for e in index):
        return None  # other advanced indices: torch's own rules (and their data dependence) apply
    consumed = sum(1 for e in index if e is not None and e is not Ellipsis)
    basic, positions, out_dim = [], [], 0
    for e in index:
        if e is Ellipsis:
            out_dim += t.dim() - consumed
        elif _is_scalar_index(e):
            positions.append((out_dim, e))
            e = slice(None)
            out_dim += 1
        elif not isinstance(e, int):  # a slice or None keeps (or adds) a dim; an int drops one
            out_dim += 1
        basic.append(e)
    advanced = [None] * out_dim
    for dim, e in positions:
        advanced[dim] = e
    return tuple(basic), advanced


def _advanced(view, positions):
    advanced = positions + [None] * (view.dim() - len(positions))
    while advanced and advanced[-1] is None:  # aten.index: trailing dims need no entry
        advanced.pop()
    return advanced


def read(t, index):
    """``t[index]``, 0-d integer tensors in ``index`` taken as advanced indices."""
    parts = split_index(t, index)
    if parts is None:
        return t[index]
    view = t[parts[0]]
    return torch.ops.aten.index.Tensor(view, _advanced(view, parts[1]))


def write(t, index, value):
    """``t[index] = value``, 0-d integer tensors in ``index`` taken as advanced indices."""
    parts = split_index(t, index)
    if parts is None:
        t[index] = value
        return
    # an index of slices alone writes into t itself, not a view: a mode sees the write's target
    # (trace.closures: a closed-over tensor written)
    whole = all(e is Ellipsis or (isinstance(e, slice) and e == slice(None)) for e in parts[0])
    view = t if whole else t[parts[0]]
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, dtype=view.dtype, device=view.device)
    torch.ops.aten.index_put_.default(view, _advanced(view, parts[1]), value.to(view.dtype))


def loop_view(t, index):
    """``t[index]`` as the loop's view at index 0 of each 0-d integer tensor in it (the same sizes
    and strides as at any index): ``stale_reads``' probe of whether a view of the read is the loop's."""
    basic, advanced = split_index(t, index)
    view = t[basic]
    for dim in sorted((d for d, e in enumerate(advanced) if e is not None), reverse=True):
        view = view.select(dim, 0)
    return view


_LOOP_VIEWS = {"read": loop_view, "select": lambda t, dim, i: t.select(dim, 0),
               "narrow": lambda t, dim, start, length: t.narrow(dim, 0, length)}


def select_at(t, dim, i):
    """``t.select(dim, i)``, a 0-d integer tensor ``i`` taken as an advanced index (a copy)."""
    return read(t, (slice(None),) * (dim % t.dim()) + (i,))


def narrow_at(t, dim, start, length):
    """``t.narrow(dim, start, length)`` with a 0-d integer tensor ``start``: the rows
    ``start + arange(length)`` as an advanced index (a copy; narrow reads ``start``'s value)."""
    rows = start + torch.arange(length, dtype=start.dtype, device=start.device)
    return torch.ops.aten.index.Tensor(t, [None] * (dim % t.dim()) + [rows])


_SELECTS = (torch.Tensor.select, torch.select)
_NARROWS = (torch.Tensor.narrow, torch.narrow)


def _is_dim(t, dim):
    return isinstance(dim, int) and -t.dim() <= dim < t.dim()


def _rewritten_read(func, args, kwargs):
    """``(thunk, kind)`` for a read this mode rewrites (``t[index]``, ``t.select(dim, i)``,
    ``t.narrow(dim, i, n)`` with 0-d integer tensors ``i``; ``kind``: its ``_LOOP_VIEWS`` entry), else None."""
    if kwargs or len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return None
    if func is _GET and len(args) == 2:
        return ((lambda: read(*args)), "read") if split_index(*args) is not None else None
    if func in _SELECTS and len(args) == 3 and _is_scalar_index(args[2]) and _is_dim(*args[:2]):
        return (lambda: select_at(*args)), "select"
    if func in _NARROWS and len(args) == 4 and _is_scalar_index(args[2]) and _is_dim(*args[:2]) \
            and isinstance(args[3], (int, torch.SymInt)):
        return (lambda: narrow_at(*args)), "narrow"
    return None


class TensorIndexRewrite(TorchFunctionMode):
    """``t[..., i, ...]`` (read and write), ``t.select(dim, i)`` and ``t.narrow(dim, i, n)`` with 0-d
    integer tensors ``i`` as advanced indexing, while a body is traced (``trace_graph``, Dynamo's speculation).

    Such a read is a copy, not the view the loop's ``select`` gives: a write through it
    (``buf[:, t].copy_(h)``, ``v = buf[:, t]; v += h``) would be lost, so a read modified in place
    and not written back with ``buf[..., t, ...] = v`` (what ``buf[:, t] += h`` does) is a
    ScanError when the trace ends. And a write into ``buf`` after the read would not show in it
    (``v = buf[t]; buf[t] = h; use(v)``: the loop's view holds ``h``; the copy held the old row, a
    silent wrong number): a read used after its tensor was written in place is read again there
    (``_fresh``), as the view would show it, and so is a view taken of it before the write
    (``buf[t].unsqueeze(0)``) where the loop's is a view of ``buf`` too (``stale_reads``). Dynamo's
    graph records the body as written (the mode only serves its fake runs): ``refresh_stale_reads=False``
    there."""

    def __init__(self, refuse_lost_writes=True, refresh_stale_reads=True):
        super().__init__()
        self._reads, self._written_back = {}, set()
        self._refuse = refuse_lost_writes  # False: a run whose values nobody reads (the ys' shape run)
        # id(read or view of one) -> stale_reads.Tracked
        self._sources, self._refresh = {}, refresh_stale_reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = None
        if self._sources:
            source = self._sources.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
            given = (args, kwargs)
            args, kwargs = _compat.pytree.tree_map(self._fresh, (args, kwargs))
        rewritten = _rewritten_read(func, args, kwargs)
        if rewritten is not None:
            out = rewritten[0]()
            self._reads[id(out)] = (out, out._version)
            if self._refresh:
                probe = stale_reads.probing(lambda: _LOOP_VIEWS[rewritten[1]](*args))
                self._sources[id(out)] = stale_reads.Tracked(out, rewritten[0], args[0], probe)
            return out
        if func is _SET and len(args) == 3 and isinstance(args[0], torch.Tensor):
            self._written_back.add(id(args[2]))
            return write(*args)
        out = func(*args, **kwargs)
        if source is not None:  # a view of a read (r.unsqueeze(0)): the loop's may be a view of buf too
            def again(value, rest=given[0][1:], kw=given[1]):
                rest, kw = _compat.pytree.tree_map(self._fresh, (rest, kw))
                return func(value, *rest, **kw)
            name = getattr(func, "__name__", None) or str(func)
            for entry in stale_reads.derived(func, again, source, out, f"a view of the read ({name})"):
                self._sources[id(entry.first)] = entry
        return out

    def _fresh(self, t):
        """What a use of the read (or view of one) ``t`` reads: ``t``, or ``t`` made again once its
        tensor was written."""
        entry = self._sources.get(id(t)) if isinstance(t, torch.Tensor) else None
        if entry is None:
            return t
        now = entry.now
        fresh = entry.current()
        if fresh is not now and id(t) in self._reads:  # a read made again: writes through it refused too
            self._reads[id(fresh)] = (fresh, fresh._version)
        return fresh

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None and self._refuse:
            self._refuse_writes_through_reads()

    def _refuse_writes_through_reads(self):
        for key, (out, version) in self._reads.items():
            if out._version != version and key not in self._written_back:
                raise ScanError(
                    "scan: the body writes in place into buf[..., t, ...] or buf.select(dim, t) taken at a "
                    f"0-d tensor index t (a {tuple(out.shape)} slice): traced, that read is a copy (the loop's "
                    "view would need t's value), so the write would be lost. Write the slice back with "
                    "buf[..., t, ...] = value (buf[:, t] += h does), or use buf.index_copy_(dim, t.view(1), ...).")


def _scalar_index_node(arg):
    value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
    return _is_scalar_index(value)


def rewrite_graph_indexing(graph):
    """A Dynamo graph's ``operator.getitem`` / ``operator.setitem`` of a tensor by an index holding a
    0-d integer tensor, and its ``select`` / ``narrow`` at one (by the nodes' example values), call
    ``read`` / ``write`` / ``select_at`` / ``narrow_at`` instead: whatever runs the graph later (a fake
    run, make_fx, the eager loop) then needs no mode. Dynamo's speculation ran them under
    ``TensorIndexRewrite``, but its graph records the call as written: strict export's later fake run
    of ``buf.select(0, t)`` read ``t``'s value (unbacked symbols, a data-dependence error)."""
    import operator

    targets = {operator.getitem: read, operator.setitem: write}
    at = {"select": (select_at, 3), "narrow": (narrow_at, 4)}
    at.update({torch.select: at["select"], torch.narrow: at["narrow"]})
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets and len(node.args) >= 2:
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if any(_scalar_index_node(e) for e in index):
                node.target = targets[node.target]
        elif node.op in ("call_method", "call_function") and node.target in at and not node.kwargs:
            fn, nargs = at[node.target]
            if len(node.args) == nargs and isinstance(node.args[1], int) and _scalar_index_node(node.args[2]):
                node.op, node.target = "call_function", fn
    _read_again_after_writes(graph)


def _read_again_after_writes(graph):
    """``TensorIndexRewrite``'s ``_fresh`` on a Dynamo graph (``stale_reads.read_again_after_writes``)."""
    probes = {read: _LOOP_VIEWS["read"], select_at: _LOOP_VIEWS["select"], narrow_at: _LOOP_VIEWS["narrow"]}
    stale_reads.read_again_after_writes(graph, probes, (write,))
