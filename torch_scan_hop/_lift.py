"""Closure lifting: tensors the body reads but does not receive become inputs.

The body is traced once with make_fx; every tensor it closed over shows up as a
``get_attr`` constant holding the very tensor object (a Parameter stays the
Parameter). Each becomes a trailing placeholder, and the tensor itself is
passed as an ``additional_inputs`` entry, so it receives gradients and is an
explicit input of every graph that contains the scan.
"""
import contextlib

import torch

from . import _compat


def _tensor_constants(gm):
    for node in list(gm.graph.find_nodes(op="get_attr")):
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor):
            yield node, value


def lift_constants(gm):
    """Rewrite ``gm`` in place so its tensor constants are trailing inputs; return them."""
    lifted, placeholder_of = [], {}
    last = list(gm.graph.find_nodes(op="placeholder"))[-1:] or [None]
    constants = list(_tensor_constants(gm))  # read all before deleting: get_attrs may share a target
    for node, value in constants:
        key = id(value)
        if key not in placeholder_of:
            anchor = last[0]
            ctx = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before()
            with ctx:
                ph = gm.graph.placeholder(f"lifted_{len(lifted)}")
            ph.meta = dict(node.meta)
            last = [ph]
            placeholder_of[key] = ph
            lifted.append(value)
        node.replace_all_uses_with(placeholder_of[key])
        gm.graph.erase_node(node)
    for node, _ in constants:
        if hasattr(gm, node.target):
            delattr(gm, node.target)
    gm.graph.lint()
    gm.recompile()
    return lifted


def trace_and_lift(flat_body, example_args):
    """(GraphModule taking (*example_args, *lifted), lifted tensors)."""
    # Under an outer trace (export's pre-dispatch make_fx) a grad-mode switch
    # would be recorded into the user's graph; the subgraph tracer needs none.
    grad_off = contextlib.nullcontext() if _compat.under_make_fx() else torch.no_grad()
    with grad_off, _compat.recording_functional_closures() as outer:
        gm = _compat.trace_graph(flat_body, example_args)
        return gm, [outer(t) for t in lift_constants(gm)]
