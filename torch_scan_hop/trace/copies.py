"""``aten.copy`` in a graph body, made differentiable where autograd runs the graph.

A body that writes its carry with ``c.copy_(v)``, traced, holds ``aten.copy`` (the functionalized
``copy_``), for which torch has no derivative: differentiating such a graph (make_fx's graph of a
scan, run under autograd: the op's joint trace, or its eager loop over the graph) failed with
"derivative for aten::copy is not implemented". The graph itself is left as it is (compilers lower
``aten.copy``); autograd gets a copy of it with each ``aten.copy`` as the same value from ops it
can differentiate.
"""
import torch

from .. import _compat
from .cache import memo


def _copy(self, src, non_blocking=False):
    """``aten.copy(self, src)``'s value: ``src`` as ``self``'s shape, dtype and device."""
    return src.to(dtype=self.dtype, device=self.device).expand(self.shape).clone()


def differentiable_copies(body):
    """``body``, or where it is a graph holding ``aten.copy``, a copy of it without."""
    copy = torch.ops.aten.copy.default
    if not isinstance(body, torch.fx.GraphModule) or not body.graph.find_nodes(op="call_function", target=copy):
        return body
    # once per graph (its code: new after any change), not per eager call of the op
    return memo(body, ("differentiable_copies", body.code), lambda: _without_copies(body, copy))


def _without_copies(body, copy):
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(body.graph, {}))
    for node in graph.find_nodes(op="call_function", target=copy):
        node.target = _copy
    return _compat.tracing.lazy_graph_module(body, graph)
