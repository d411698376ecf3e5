"""Dynamo: stacked storage's per-call parameter check, made once when tracing.

Every ``scan_layers`` call over stacked storage must know that every layer still
holds the Parameter objects whose rows the stack is (``functional_call`` may have
swapped one, a submodule may have been replaced). Traced as Python, that check
made Dynamo wrap every layer parameter as a tensor, ~2.5 ms each: ~2 s of
compile time at depth 64 (768 parameters), the first call no longer flat in depth.

So under Dynamo the check is the call of a tiny HigherOrderOperator whose tracker
runs the check on the real objects and keeps its answer true with one ID_MATCH
guard per parameter (no tensor wrapped, no TENSOR_MATCH). Where the real objects
may not be what the traced code sees (the frame already changed one of them,
e.g. ``functional_call`` inside the compiled function), or the answer is no, the
Python check is traced as before.
"""
import warnings

import torch

from .. import _compat
from . import trace_time
from .ownership import layers_hold_stack_parameters

_NAME = "torch_scan_hop_layers_intact"


class LayersIntactOp(_compat.HigherOrderOperator):
    """``layers_intact(container)``: every layer holds the stack's Parameters.
    Called only under Dynamo (which never runs it: the tracker answers); called
    eagerly it is the Python check."""

    def __init__(self):
        super().__init__(_NAME)

    def __call__(self, container):
        return layers_hold_stack_parameters(container)


_layers_intact = LayersIntactOp()
_installed = [False]


def layers_intact(container):
    """Under Dynamo: the check, answered by the tracker (traced as Python where
    this torch's Dynamo could not take the tracker)."""
    if _installed[0]:
        return _layers_intact(container)
    return layers_hold_stack_parameters(container)


def _parameter_sources(container, source):
    """The real objects' answer: ``(sources, objects)`` with the source of every
    layer parameter in the stack and every object the walk read (to ask Dynamo
    whether the frame changed one), or None when some layer no longer holds the
    stack's Parameter (a swapped tensor, a replaced submodule)."""
    from .._compat import dynamo as dyn

    ids = container.__dict__["_scan_ids"]
    keys = list(container._modules)
    objects = [container, container._modules]
    layer_sources = [dyn.dict_item_source(dyn.attr_source(source, "_modules"), k) for k in keys]
    sources = []
    for name, want in ids.items():
        if len(want) != len(keys):
            return None
        *path, leaf = name.split(".")
        for key, src, expected in zip(keys, layer_sources, want):
            m = container._modules[key]
            for part in path:
                objects += (m, m._modules)
                m = m._modules.get(part) if isinstance(m, torch.nn.Module) else None
                src = dyn.dict_item_source(dyn.attr_source(src, "_modules"), part)
            if not isinstance(m, torch.nn.Module):
                return None
            objects += (m, m._parameters)
            p = m._parameters.get(leaf)
            if not isinstance(p, torch.nn.Parameter) or id(p) != expected:
                return None
            sources.append(dyn.dict_item_source(dyn.attr_source(src, "_parameters"), leaf))
    return sources, objects


def _answered_with_guards(tx, var):
    """True when the real objects say every layer holds the stack's Parameters, the frame
    has changed none of them, and the identity guards are installed. A Dynamo internal
    that moved in some torch (AttributeError, ImportError, TypeError from ``_compat``)
    answers False: the check is then traced, slower but right."""
    from .._compat import dynamo as dyn

    try:
        found = dyn.module_and_source(var)
        answer = None if found is None else _parameter_sources(*found)
        if answer is None or dyn.modified_in_trace(tx, answer[1]):
            return False
        dyn.guard_identity(answer[0])
    except (AttributeError, ImportError, TypeError) as e:
        warnings.warn(f"torch_scan_hop: stacked storage's check is traced under torch.compile ({e!r}).")
        return False
    return True


def _make_tracker_class():
    from .._compat import dynamo as dyn

    class LayersIntactVariable(dyn.hop_tracker_base(_NAME)):
        def _call_function(self, tx, args, kwargs):
            args = dyn.realize_all(list(args))
            if len(args) == 1 and not kwargs and _answered_with_guards(tx, args[0]):
                return dyn.constant(True)
            return dyn.inlined(tx, layers_hold_stack_parameters)(*args, **kwargs)

    return LayersIntactVariable


def install():
    """Register the tracker for our op's name (idempotent)."""
    _installed[0] = trace_time.install_tracker(
        _NAME, _make_tracker_class, "of stacked storage's check",
        "the check is traced, compile time then grows with depth")
