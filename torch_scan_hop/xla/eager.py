"""Eager ``scan`` on XLA tensors: Dynamo's guards say when a body is unchanged.

On XLA a scan is a traced graph (one While), and a trace of the body by make_fx
costs milliseconds per op: with the joint, ~1 s per training step of a decoder
layer, ten times the Python loop's own lazy trace. The plan and the While are
reused by graph (``trace.cache``), but only a trace can tell that the graph is
unchanged: no key on a Python function sees all it reads. Dynamo's guards do.

So an eager scan on XLA runs through ``torch.compile(backend="eager")``: Dynamo
captures the call as one scan node (``op.dynamo``) and guards on what the
body read; the captured graph runs as it is, and its scan node, a graph body,
finds its plan and While by graph. A call whose guards hold costs a guard check.
A body Dynamo cannot capture whole (a print, an unsupported construct) takes
the make_fx path, as before, and is not offered to Dynamo again; so do calls
past the recompile limit of a body code (``_RECOMPILES``).

The first call of a body code on given input shapes takes the make_fx path
too (``first_sight``): it must trace the body and compile a While anyway, and
Dynamo's capture (its trace of the call, its guards, a fake run of the op)
costs more than the make_fx trace it would save, two to three times the call's
own work (xla_compile.py's RNN, a first training call at N=10 on a busy box:
the scan call 0.35-0.92 s captured, 0.08-0.21 s traced; torch_xla's scan
0.07-0.20 s). A scan run once per shape (an evaluation, a shape sweep) never
pays it; a call that comes back with the same shapes is captured then, its
autograd plan found by its joint (``trace.cache``), and every call after it
costs a guard check. A training loop thus pays the capture at its second step
and the make_fx trace once more than before (scan_model's Llama, depth 4: its
first two steps 15.6 s against 14.7 s, XLA's compile most of both).
The two routes leave the same program at the step's sync, so XLA compiles a
training step once: the make_fx route keeps none of the user's tensors alive
past the call (``trace.lift.forget_source``, ``trace.graph.forget_constants``,
the tracer's constants in ``_compat.tracing``), and neither route lifts a
closure that only a dead ``detach`` reads (each had made the first step's
program differ from the next one's: scan_model's stacked weights, its hidden
state, live at the first sync only).
Which path runs never changes a result: make_fx traces the body afresh,
Dynamo's guards check what it read.

A first call whose make_fx trace fails where only Dynamo can trace the body
(``needs_capture``: a ``torch.cond`` or ``while_loop`` the body calls itself)
takes the capture at once, as under torch.compile.
"""
import collections
import threading
import types

import torch

from .. import _compat
from ..core import grad_reach, modes, trace_lock
from . import mesh_texts

_MAX_BODIES = 256  # distinct body codes with an entry of their own
# compiles per body code: each new shape is one (static shapes: XLA compiles per
# shape anyway), and past the limit calls take the make_fx path (Dynamo's default: 8)
_RECOMPILES = 64
_lock = threading.Lock()
_entries = {}  # body code -> compiled entry (one per code: Dynamo's recompile limit counts per code)
_refused = set()  # bodies Dynamo could not capture: (code, closure types)
_MAX_SEEN = 4096
_seen = collections.OrderedDict()  # (code, input signature) of calls made on the make_fx path
mesh_texts.keep_mesh_texts()  # now if torch_xla's SPMD module is loaded, so that meshes made next keep theirs


def applies(fn, leaves, remat):
    """A plain eager call on XLA tensors, with no tracer, transform or mode active."""
    if callable(remat) or not leaves or getattr(fn, "__code__", None) is None or _compat.is_dynamo_compiling():
        return False  # under Dynamo: a scan in a captured body, which Dynamo captures with it
    if not all(isinstance(t, torch.Tensor) and t.device.type == "xla" and not modes.is_functional(t)
               for t in leaves):  # first: off XLA (most calls) this is one device check
        return False
    if _compat.dispatch_modes_active() or trace_lock.under_make_fx() \
            or _compat.functorch_transforms_active():
        return False
    return _body_key(fn) not in _refused


def _body_key(fn):
    """What a Dynamo failure is remembered by: the body's code and what its closure holds."""
    cells = getattr(fn, "__closure__", None) or ()
    return fn.__code__, tuple(type(grad_reach.cell_contents(c)) for c in cells)


def first_sight(fn, leaves, options):
    """Is this the first call of ``fn``'s code with these inputs' shapes, dtypes,
    requires_grad, options and closed-over tensors' metadata? Records
    it: the next such call is not. Only the route depends on it, never a result:
    a key that misses a change (a tensor held deeper in the closure) merely
    sends a call to Dynamo's capture, which sees the change itself."""
    cells = tuple(_meta(grad_reach.cell_contents(c)) for c in getattr(fn, "__closure__", None) or ())
    # no grad mode in the key: both routes give the loop's values and gradients in either mode
    key = (fn.__code__, tuple(sorted(options.items())), cells, tuple(_meta(t) for t in leaves))
    with _lock:
        if key in _seen:
            _seen.move_to_end(key)
            return False
        _seen[key] = None
        if len(_seen) > _MAX_SEEN:
            _seen.popitem(last=False)
    return True


def needs_capture(error):
    """Whether the make_fx trace of a body failed where only Dynamo's capture can trace it: a
    higher-order op the body calls itself (``torch.cond``, upstream's ``while_loop``) compiles its
    own call with Dynamo when no Dynamo trace is running, and that Dynamo then traces scan's
    closure stand-ins and refuses them. Such a call takes the capture (as under torch.compile);
    if the capture fails too, the make_fx path runs again and raises the body's own error."""
    return isinstance(error, _compat.dynamo.unsupported_error_classes())


def _meta(v):
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype, v.device.type, v.requires_grad
    return type(v)


def _run(scan_impl, fn, init, xs, options):
    return scan_impl(fn, init, xs, **options)


def _entry_for(code):
    """The compiled entry of one body code, with a code object of its own."""
    with _lock:
        entry = _entries.get(code)
        if entry is None:
            if len(_entries) >= _MAX_BODIES:
                _entries.pop(next(iter(_entries)))
            own = types.FunctionType(_run.__code__.replace(co_name=f"scan_of_{code.co_name}"), _run.__globals__)
            entry = _entries[code] = torch.compile(own, backend="eager", fullgraph=True, dynamic=False)
        return entry


class NotCaptured(Exception):
    """Dynamo did not capture this call; the make_fx path runs it instead."""

    def __init__(self, key):
        super().__init__()
        self.key = key
        self.mesh_texts = mesh_texts.mesh_texts_made()


def call(scan_impl, fn, init, xs, options):
    """``scan_impl(fn, init, xs, **options)`` captured by Dynamo (``scan_impl`` must not route here again)."""
    mesh_texts.keep_mesh_texts()  # SPMD bodies: see there
    try:
        with _compat.dynamo.recompile_limit_at_least(_RECOMPILES):
            return _entry_for(fn.__code__)(scan_impl, fn, init, xs, options)
    except Exception as e:
        raise NotCaptured(_body_key(fn)) from e


def refuse(failure):
    """The make_fx path ran a body Dynamo failed on (``failure``, the NotCaptured):
    do not offer it to Dynamo again, unless that run made the text of an SPMD mesh
    the capture could not read before (``mesh_texts.keep_mesh_texts``)."""
    if mesh_texts.mesh_texts_made() != failure.mesh_texts:
        return
    with _lock:
        _refused.add(failure.key)


def clear():
    with _lock:
        _entries.clear()
        _refused.clear()
        _seen.clear()
