"""Layer kinds whose code traces to one graph, told before the scan: the step is then one
layer's code, with no ``cond``.

``layers.alike`` runs a stack of several kinds as one scan whose step picks each layer's code
with ``torch.cond``; Dynamo's tracker replaces a cond whose branches traced alike by one branch
(``trace.same_branches``), but only after speculating both. At Gemma 3's size that costs a first
XLA training step ~40% more than one layer's code (Dynamo traces both branches, runs the cond
for its example value, differentiates it). Where the scan is called outside any trace (an eager
call on XLA tensors, which Dynamo captures next), each kind's code is traced here by make_fx on
fake copies of the first step's operands (~0.1 s a layer against seconds in Dynamo); when all
trace to one graph, the step runs the first kind's code for every layer. The attributes that
tell the kinds apart are excused from the view's check on read (they were just shown not to
reach the graph); every other attribute the code reads is checked against every layer.

Counted per call (``counts()``). Kept per stack and input signature (shapes, dtypes, plain values, training flags), as the kinds
themselves are (``patterns.stack_alike``): attributes changed after a stack's first call are
seen by neither. Under Dynamo the same question is asked by its tracker at trace time, on the
operands' fake example values (``layers.trace_time``), where it costs the same; under make_fx
and the like nothing is decided here (False): the cond runs.
"""
import collections
import weakref

import torch

from .. import _compat
from ..core import modes
from ..core.trees import ScanError
from ..trace.graph import trace_aten_graph
from ..trace.same_branches import same_graph
from .patterns import tree_signature

_MAX_SIGNATURES = 64  # per stack: past it the answers are forgotten and traced again
_known = weakref.WeakKeyDictionary()  # a stack's first layer -> {signature: bool}
_ABSENT = object()
_counts = collections.Counter()


def counts():
    """Stacks told before their scan: ``alike`` (one code, no cond), ``differ`` (the cond runs)."""
    return dict(_counts)


def may_decide():
    """Outside any trace (Dynamo's, make_fx's), where Python runs on the operands as they are
    (also Dynamo's tracker at trace time): only there are kinds told apart before the scan."""
    return not _compat.is_dynamo_compiling() and not modes.tracing_modes_active()


def traces_alike(layers, kinds, branches, operands, plain):
    """Whether every kind's branch (``branches[k](*operands)``) traces to one graph; False under
    a trace, or when a branch cannot be traced on fake inputs (the cond then decides). ``plain``:
    the values besides ``operands`` the branches read (keyword values that are not tensors).

    Raises:
        ScanError: a layer differs from its kind's first in an attribute the code reads (the
            view's check on read), as the scan itself would raise it."""
    if not may_decide():
        return False
    key = _signature(layers, kinds, (operands, plain))
    if key is None:
        return False
    known = _known.setdefault(layers[0], {})
    if key not in known:
        if len(known) >= _MAX_SIGNATURES:
            known.clear()
        known[key] = _one_graph(branches, operands)
    _counts["alike" if known[key] else "differ"] += 1
    return known[key]


def excused_paths(layers, kinds):
    """The attribute paths (``self_attn.sliding_window``) that tell the kinds apart: one value in
    all layers of a kind, another in another kind. Not per-layer data (``layer_idx``, a value per
    layer): that is checked on read as before, since two kinds' first layers tracing alike says
    nothing about the values of the others."""
    sigs = [dict(tree_signature(layer)) for layer in layers]
    paths = set().union(*sigs)

    def per_kind(path):
        values = {}
        for sig, kind in zip(sigs, kinds):
            value = sig.get(path, _ABSENT)
            if values.setdefault(kind, value) != value:
                return None  # differs inside a kind
        return values

    excused = set()
    for path in paths:
        values = per_kind(path)
        if values is not None and any(v != values[kinds[0]] for v in values.values()):
            excused.add(path)
    return frozenset(excused)


def _one_graph(branches, operands):
    graphs = []
    for run in branches:
        try:
            graphs.append(trace_aten_graph(run, list(operands)))
        except ScanError:
            raise
        except Exception:  # noqa: BLE001 -- e.g. a tensor closed over: the cond traces it instead
            return False
    return all(same_graph(graphs[0], gm) for gm in graphs[1:])


def _signature(layers, kinds, operands):
    """What the answer depends on besides the layers' attributes, hashable; None if a plain
    value in the operands' tree is not."""
    leaves = []
    flat, spec = _compat.pytree.tree_flatten(operands)
    for v in flat:
        if isinstance(v, torch.Tensor):
            leaves.append((tuple(v.shape), v.dtype, v.device.type, v.requires_grad))
        else:
            leaves.append((type(v), v))
    key = (tuple(id(layer) for layer in layers), tuple(kinds), tuple(layer.training for layer in layers),
           torch.is_grad_enabled(), str(spec), tuple(leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key
