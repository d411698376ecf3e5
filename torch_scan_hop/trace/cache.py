"""Reuse of expensive work (partitioning, XLA lowering), keyed by graphs.

Nothing is keyed on a Python function: no fingerprint of a function can see
everything it reads (globals inside methods, hooks, class attributes, tensors
read as Python values...). Bodies are traced on every call instead, and what
is derived from a trace is reused only for an identical graph: ``graph_key``
describes every node, target, constant and literal of a GraphModule, so two
graphs with the same key compute the same thing.

* ``plan_for``: joint graph (or a body graph that determines it) + input
  metadata + reverse + remat -> the autograd plan (partitioned step graphs).
* ``by_graph``: body graph + extra key -> e.g. the lowered XLA While.

Both are small LRUs. Work under a tracer (make_fx, fake mode, Dynamo) is not
kept in them: its tensors must not outlive the trace. But one trace asks for the
same plan many times: AOT runs a graph more than once (metadata, then the joint),
a scan nested in another's body is re-planned on each of the outer body's traces,
and identical bodies (a layer scanned on its own and nested in a block) repeat.
``plan_for(..., scope=fake_mode)`` keeps those plans with the trace's fake mode
instead, and they die with it.
"""
import collections
import threading
import types
import weakref

import torch

from .. import _compat
from ..core.aten_nodes import VALUE_IDENTITIES

_MAX_ENTRIES = 64
_SMALL_CONSTANT = 4096  # elements: constants up to this size are keyed by value
_LITERALS = (type(None), bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Uncacheable(Exception):
    pass


class _GraphKey:
    """Builds the key of a graph; collects weak references to tensors keyed by identity.
    ``flat``: the key read no tensor and no nested graph, so it is a function of the
    GraphModule's own graph and code (``graph_key`` remembers it for the module)."""

    def __init__(self, values_only=False):
        self.refs = []
        self.flat = True
        self.values_only = values_only

    def graph(self, gm):
        index = {}
        parts = []
        for node in gm.graph.nodes:
            if self.values_only and node.op == "call_function" and node.target in VALUE_IDENTITIES:
                index[node] = index[node.args[0]]  # the value of its input
                continue
            index[node] = len(parts)
            parts.append((node.op, self.target(gm, node), self.arg(node.args, index),
                          self.arg(node.kwargs, index), self.meta(node)))
        return tuple(parts)

    def target(self, gm, node):
        if node.op == "get_attr":
            return self.value(resolve_attr(gm, node.target))
        if node.op in ("placeholder", "output"):
            return None
        return self.callable(node.target)

    def callable(self, target):
        if isinstance(target, str):  # call_method
            return ("method", target)
        if _compat.is_op_or_packet(target):
            return ("op", str(target))
        if _compat.is_hop(target):
            return ("hop", target.name(), self.identity(target))
        if isinstance(target, types.BuiltinFunctionType):
            return ("builtin", target.__module__, target.__qualname__)
        if isinstance(target, types.FunctionType):
            return ("fn", self.identity(target))
        body = getattr(target, "body", None)  # a node target with its body bound (the XLA form)
        if isinstance(body, torch.fx.GraphModule):
            self.flat = False
            return ("bound", type(target).__qualname__, self.graph(body))
        raise _Uncacheable

    def identity(self, obj):
        try:
            self.refs.append(weakref.ref(obj))
        except TypeError:
            raise _Uncacheable from None
        return id(obj)

    def value(self, v):
        self.flat = False  # a get_attr: a tensor (data, version) or a subgraph, each changeable on its own
        if isinstance(v, torch.fx.GraphModule):
            return ("graph", self.graph(v))
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        raise _Uncacheable

    def tensor(self, t):
        meta = (tuple(t.shape), t.dtype, str(t.device), t.requires_grad)
        if t.device.type == "cpu" and t.numel() <= _SMALL_CONSTANT and type(t) in (torch.Tensor, torch.nn.Parameter):
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            return ("value", meta, data.numpy().tobytes())
        return ("tensor", meta, self.identity(t), _compat.tensor_version(t))

    def arg(self, a, index):
        if isinstance(a, torch.fx.Node):
            return ("node", index[a])
        if isinstance(a, float):
            return ("float", a.hex())  # keeps 0.0 and -0.0 apart
        if isinstance(a, complex):
            return ("complex", a.real.hex(), a.imag.hex())
        if isinstance(a, _LITERALS):
            return (type(a).__name__, str(a) if not isinstance(a, (bool, int, str, type(None))) else a)
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(self.arg(e, index) for e in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, self.arg(v, index)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", self.arg((a.start, a.stop, a.step), index))
        if a is Ellipsis:
            return ("...",)
        raise _Uncacheable

    def meta(self, node):
        if node.op != "placeholder":
            return None
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return (tuple(val.shape), tuple(val.stride()), val.dtype, str(val.device), val.requires_grad)
        return repr(val)


def resolve_attr(gm, target):
    """The object a ``get_attr`` target names, from ``gm``."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_flat_keys = weakref.WeakKeyDictionary()  # GraphModule -> (weak ref to its graph, its code, key, refs)


def graph_key(gm, values_only=False):
    """(hashable key, weak refs that must stay alive) of what ``gm`` computes, or None.
    ``values_only``: for a graph no autograd will see (a joint), ``detach`` and ``alias``
    are skipped, their users keyed on their input.

    The key of a graph that reads no tensor and no subgraph (a Dynamo body, a
    partitioned step) is remembered for the module while its graph object and
    generated code are the same objects (``recompile`` makes new code): a steady
    scan on XLA asks three times per step (plan, forward and backward lowering),
    ~0.1 ms each to build at a layer's size."""
    memo = None if values_only else _flat_keys.get(gm)
    if memo is not None and memo[0]() is gm.graph and memo[1] is gm.code and all(r() is not None for r in memo[3]):
        return memo[2], memo[3]
    builder = _GraphKey(values_only)
    try:
        key = builder.graph(gm)
        hash(key)
    except (_Uncacheable, TypeError, RecursionError, RuntimeError):
        return None
    if builder.flat and not values_only:  # the graph held weakly: it holds its module, which would then never die
        _flat_keys[gm] = (weakref.ref(gm.graph), gm.code, key, builder.refs)
    return key, builder.refs


def _ambient_state():
    """Global state that changes what a trace records."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def tensor_meta(tensors, with_grad=False, drop_lead=False):
    """Shapes/dtypes/devices (and requires_grad); ``drop_lead`` keys xs by their
    slice shape: the body never sees the length, so a new length reuses it."""
    start = 1 if drop_lead else 0
    return tuple((tuple(t.shape[start:]), t.dtype, t.device, t.requires_grad if with_grad else None)
                 if isinstance(t, torch.Tensor) else ("scalar", t) for t in tensors)


class _LRU:
    """A small thread-safe LRU whose entries die with the tensors their key names."""

    def __init__(self, size=_MAX_ENTRIES):
        self.size, self.entries, self.lock = size, collections.OrderedDict(), threading.Lock()

    def get_or_build(self, key, refs, build):
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None and all(r() is not None for r in hit[0]):
                self.entries.move_to_end(key)
                return hit[1]
        value = build()
        with self.lock:
            self.entries[key] = (refs, value)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return value

    def clear(self):
        with self.lock:
            self.entries.clear()


_plans = _LRU()
_graphs = _LRU()


def by_graph(gm, key, build):
    """``build()`` once per (graph content of ``gm``, key); uncacheable graphs build every time."""
    found = graph_key(gm) if isinstance(gm, torch.fx.GraphModule) else None
    if found is None:
        return build()
    graph, refs = found
    return _graphs.get_or_build((graph, key, _ambient_state()), refs, build)


def plan_for(gm, init, xs, additional_inputs, reverse, remat, build, keyed_by="joint", scope=None):
    """The autograd plan, once per (graph ``gm``, per-step input metadata, reverse, remat).
    ``keyed_by``: what ``gm`` is, the step's joint or a body graph that determines it. A joint is
    keyed by its values only (``graph_key``): the joint of a body traced from the user's function
    reads its closures through detaches that Dynamo's capture of the same body does not have.
    ``scope``: the fake mode of the trace asking (its plans are kept with it), else None."""
    found = graph_key(gm, values_only=keyed_by == "joint")
    if found is None:
        return build()
    graph, refs = found
    meta = (tensor_meta(init, True), tensor_meta(xs, True, drop_lead=True), tensor_meta(additional_inputs, True))
    remat_key = remat if isinstance(remat, str) else ("callable", id(remat))
    if not isinstance(remat, str):
        refs = [*refs, weakref.ref(remat)] if _weakrefable(remat) else None
        if refs is None:
            return build()
    key = (keyed_by, graph, meta, reverse, remat_key, _ambient_state())
    if scope is not None:  # kept with the trace's fake mode, forgotten with it
        return memo(scope, key, build)
    return _plans.get_or_build(key, refs, build)


def _weakrefable(v):
    try:
        weakref.ref(v)
        return True
    except TypeError:
        return False


_memos = weakref.WeakKeyDictionary()


def memo(owner, key, build):
    """``build()`` once per (owner object, key); forgotten with the owner.

    Owners that cannot be weakly referenced (or keys that cannot be hashed)
    are not cached: build() runs every time.
    """
    try:
        per_owner = _memos.setdefault(owner, {})
        hash(key)
    except TypeError:
        return build()
    value = per_owner.get(key)
    if value is None:
        value = per_owner[key] = build()
    return value


def clear():
    """Forget every cached plan and lowering (never needed for correctness)."""
    _plans.clear()
    _graphs.clear()
    _memos.clear()
    _flat_keys.clear()
