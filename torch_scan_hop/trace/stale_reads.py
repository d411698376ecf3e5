"""Reads at a 0-d tensor index that the loop holds as views, followed through views of them.

Traced, ``buf[t]`` is a copy (``trace.indexing``); the loop's is a view of ``buf``, which shows a
later ``buf[t] = h``. A read used after such a write is read again there, and so is a view taken
of it before the write (``r = buf[t].unsqueeze(0); buf[t] = h; use(r)``): the loop's ``r`` is a
view of ``buf`` too. Not always: the loop's ``buf[:, t].reshape(-1)`` is a copy (the column is not
contiguous) where the traced copy's reshape is a view. Which the loop gives is told by a probe:
the loop's own view of ``buf`` at index 0 (the same sizes and strides as at any index), the same
calls applied to it, and whether the result still shares ``buf``'s storage. A view the probe
cannot tell about (a call that fails on it) and that is used after a write is a ScanError naming
the read, never the old row.

- ``Tracked`` / ``derived``: the bookkeeping ``TensorIndexRewrite`` (a torch-function mode) keeps
  for a read and its views, and when each is read again;
- ``read_again_after_writes``: the same on a Dynamo graph (which records the body as written);
- ``probing``: the loop's view made aside from the traced graph.
"""
import torch

from .. import _compat
from ..core.trees import ScanError
from .closures import writes_in_place

UNKNOWN = object()  # a probe that could not be computed


def storage(t):
    """``t``'s storage as a comparable key (a vmap's batched tensor's: its batched value's), or None."""
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        t = _compat.below_functorch_wrappers(t)
        return StorageWeakRef(t.untyped_storage()) if isinstance(t, torch.Tensor) else None
    except (NotImplementedError, RuntimeError, AttributeError):
        return None


def _aliases(a, b):
    sa, sb = storage(a), storage(b)
    return None if sa is None or sb is None else sa == sb


def probing(make):
    """``make()``, the loop's view for a read at index 0 (the same sizes and strides as at any
    index), made without recording it into a traced graph; UNKNOWN where it cannot be made."""
    try:
        with _compat.disable_proxy_modes_tracing():  # a probe, not part of the traced body
            return make()
    except Exception:  # noqa: BLE001 (a probe: whatever fails, the loop's aliasing is unknown)
        return UNKNOWN


def _probe_call(call, probe, base):
    """``call(probe)`` and whether the loop's result is a view of ``base``: ``(probe, True)``,
    ``(None, False)`` for a copy, ``(UNKNOWN, None)`` where it cannot be told."""
    if probe is UNKNOWN:
        return UNKNOWN, None
    try:
        with _compat.disable_proxy_modes_tracing():
            out = call(probe)
    except Exception:  # noqa: BLE001 (the loop's own call may fail there: the user hears of it if it matters)
        return UNKNOWN, None
    alias = _aliases(out, base) if isinstance(out, torch.Tensor) else False
    return (out, True) if alias else (UNKNOWN, None) if alias is None else (None, False)


class Tracked:
    """A read (or a view of one) whose uses may need it read again: ``first`` is the tensor the body
    holds, ``now`` the value its uses take, ``recompute`` makes it again, ``base`` the tensor read
    from (with the version ``now`` shows), ``probe`` the loop's counterpart (UNKNOWN: not known; a
    read itself, ``what`` None, is always the loop's view, known or not)."""

    def __init__(self, first, recompute, base, probe, what=None):
        self.first, self.now, self.recompute, self.base, self.probe = first, first, recompute, base, probe
        self.base_version, self.own_version, self.what = base._version, first._version, what

    def current(self):
        """``now``, read again first when ``base`` was written since (unless ``first`` was written
        itself: a write through the read, refused or written back elsewhere)."""
        if self.base._version == self.base_version or self.first._version != self.own_version:
            return self.now
        if self.probe is UNKNOWN and self.what is not None:
            raise _untold_view(self.what)
        self.now = self.recompute()
        self.base_version = self.base._version
        return self.now


def derived(func, call, source, out, what):
    """``Tracked`` entries for the tensors of ``out = call(source.now)`` (``func``'s call) the loop holds
    as views of ``source.base`` (``call`` recomputes it from a tensor; one entry per such output). A
    write into the read (``r.add_(1)``) is none: it is not probed either (the probe is a view of
    ``buf``, which it would write)."""
    if writes_in_place(func):
        return []
    outs = out if isinstance(out, (tuple, list)) else (out,)
    found = []
    for k, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            continue
        pick = (lambda v, k=k: v[k]) if isinstance(out, (tuple, list)) else (lambda v: v)
        probe, alias = _probe_call(lambda p: pick(call(p)), source.probe, source.base)
        if o is source.now or not (alias or (alias is None and _aliases(o, source.now) is True)):
            continue  # the loop's is a copy (or nothing tells it is a view): it keeps the old row, as the loop's
        found.append(Tracked(o, lambda pick=pick: pick(call(source.current())), source.base, probe, what))
    return found


def _example(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node


def _node_call(node):
    """``node``'s call on its example values, its first input taken from the argument."""
    args = _compat.pytree.tree_map(_example, (node.args[1:], dict(node.kwargs)))
    if node.op == "call_method":
        return lambda v: getattr(v, node.target)(*args[0], **args[1])
    return lambda v: node.target(v, *args[0], **args[1])


def read_again_after_writes(graph, probes, writes):
    """``Tracked`` on a Dynamo graph: a use of a read (``probes``: its targets -> the loop's view for
    its example arguments, at index 0) or of a view of one, after an in-place write into the storage
    it was read from, uses the read (and the views) done again just before it, as the loop's views
    would show the write; ``writes``: the targets writing into their first argument besides
    ``operator.setitem`` and torch's in-place ops."""
    reads = {}  # node -> [node its uses take now, storage read from, written since, probe, its source]
    again_of = {}  # a read (or view) made again -> the node it stands for
    for node in list(graph.nodes):
        for r in [n for n in node.all_input_nodes if n in reads]:
            current = _fresh_node(graph, reads, r, node)
            if current is not r:
                again_of[current] = r
                node.replace_input_with(r, current)
        if node.op == "call_function" and node.target in probes and node.args:
            example_args = _compat.pytree.tree_map(_example, node.args)
            probe = probing(lambda: probes[node.target](*example_args))
            reads[node] = [node, storage(_example(node.args[0])), False, probe, None]
        elif node.op in ("call_method", "call_function") and node.args and not _writes_first_arg(node, writes) \
                and again_of.get(node.args[0], node.args[0]) in reads:
            key = again_of.get(node.args[0], node.args[0])
            probe, alias = _probe_call(_node_call(node), reads[key][3], _base_example(reads, key))
            if alias or (alias is None and _aliases(_example(node), _example(node.args[0])) is True):
                reads[node] = [node, reads[key][1], False, probe, key]
        if _writes_first_arg(node, writes) and node.args:
            written = storage(_example(node.args[0]))
            for entry in reads.values():
                entry[2] = entry[2] or (written is not None and entry[1] == written)


def _base_example(reads, node):
    while reads[node][4] is not None:
        node = reads[node][4]
    return _example(node.args[0])


def _fresh_node(graph, reads, r, user):
    """The node ``user`` takes for the read (or view) ``r``: made again before ``user`` when written."""
    entry = reads[r]
    if entry[2]:
        if entry[3] is UNKNOWN and entry[4] is not None:  # (a read itself is the loop's view, known or not)
            raise _untold_view(_what(r))
        args = r.args
        if entry[4] is not None:  # a view: of its source, made again first
            args = (_fresh_node(graph, reads, entry[4], user), *r.args[1:])
        with graph.inserting_before(user):
            again = graph.create_node(r.op, r.target, args, dict(r.kwargs))
        again.meta = dict(r.meta)
        entry[0], entry[2] = again, False
    return entry[0]


def _untold_view(what):
    """The error for a view of a read, used after a write, that the probe could not tell about."""
    return ScanError(
        f"scan: {what} taken from buf[..., t, ...] (read at a 0-d tensor index t) is used after a "
        "write into buf: traced, the read is a copy, and whether the loop's value is a view of buf "
        "(and shows the write) could not be told. Take the read after the write, or .clone() it first.")


def _what(node):
    return f"{node.target}" if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def _writes_first_arg(node, writes):
    import operator

    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    return node.op == "call_function" and (node.target in (*writes, operator.setitem) or (
        getattr(node.target, "__name__", "").endswith("_") and not node.target.__name__.endswith("__")))
