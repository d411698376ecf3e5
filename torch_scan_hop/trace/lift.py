"""Closure lifting: tensors the body reads but does not receive become inputs.

The body is traced once with make_fx; every tensor it closed over shows up as a
``get_attr`` constant holding the very tensor object (a Parameter stays the
Parameter). Each becomes a trailing placeholder, and the tensor itself is
passed as an ``additional_inputs`` entry, so it receives gradients and is an
explicit input of every graph that contains the scan.
"""
import weakref
from dataclasses import dataclass

import torch

from .closures import recording_functional_closures
from .graph import trace_graph


def _tensor_constants(gm):
    """(get_attr node, tensor) pairs, collected before any is rewritten: one
    constant read several times has several nodes naming the same attribute."""
    pairs = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor):
            pairs.append((node, value))
    return pairs


def lift_constants(gm):
    """Rewrite ``gm`` in place so its tensor constants are trailing inputs; return them
    (``trace_graph`` has dropped the constants only dead aliases read)."""
    lifted, placeholder_of = [], {}
    last = list(gm.graph.find_nodes(op="placeholder"))[-1:] or [None]
    constants = _tensor_constants(gm)
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


@dataclass(frozen=True)
class Source:
    """What a lifted body graph was traced from: the user's flat body (which
    reads its closures itself) and the user's tensors lifted out of it, in order
    (the op may receive device copies of them, see ``op_input``)."""

    body: object
    lifted: tuple


_sources = weakref.WeakKeyDictionary()


def source_of(gm):
    """The ``Source`` of a graph made by ``trace_and_lift``, else None."""
    try:
        return _sources.get(gm)
    except TypeError:  # not weakly referenceable: not one of ours
        return None


def forget_source(gm):
    """Drop ``gm``'s Source once the call that traced it is done (an eager call on XLA, whose
    graph no later call or outer trace reads). An FX graph and its GraphModule refer to each
    other, so the graph, its entry here and the user's tensors the entry holds lived until
    Python's gc ran; on XLA a live tensor is an output of the step's program (scan_model's
    weights, stacked anew each step), which then differed from the next step's."""
    _sources.pop(gm, None)


def trace_and_lift(flat_body, example_args):
    """(GraphModule taking (*example_args, *lifted), lifted tensors).

    The graph is for running the body; its gradient is traced from
    ``flat_body`` itself (``trace.joint``), which this records as its source.
    """
    # Traced in the caller's grad mode: a body that branches on
    # torch.is_grad_enabled() takes the branch the loop would take.
    with recording_functional_closures(example_args) as closures:
        gm = trace_graph(flat_body, example_args)
        users = [closures.outer(t) for t in lift_constants(gm)]
    lifted = [closures.op_input(t) for t in users]  # outside the stand-ins: a real device copy
    _sources[gm] = Source(flat_body, tuple(users))
    return gm, lifted
