"""ProxyTorchDispatchMode: make_fx records ONE scan node with the body as a subgraph.

The emitted node has upstream's exact form (no kwargs), because inductor's
``decompose_scan_to_while_loop`` and the exporters read it positionally:
``reverse`` becomes ``flip`` around the node, ``remat``/``unroll`` were
already consumed by the autograd/XLA rules.
"""
import torch
import torch.utils._pytree as pytree

from . import _compat
from ._op import example_args, scan_op, split_out
from .rule_fake import check_body_carry
from .rule_functionalize import check_graph_mutation


def trace_body(combine_fn, init, xs, additional_inputs):
    with _compat.disable_proxy_modes_tracing():
        args = example_args(init, xs, additional_inputs)
    return _compat.reenter_make_fx(combine_fn)(*args)


def _body_outputs(body):
    (out,) = body.graph.find_nodes(op="output")[0].args
    return [n.meta["val"] for n in out]


def emit_scan_node(mode, combine_fn, init, xs, additional_inputs):
    body = trace_body(combine_fn, init, xs, additional_inputs)
    with _compat.disable_proxy_modes_tracing():
        check_graph_mutation(body, len(init), len(xs))
    check_body_carry(init, _body_outputs(body)[: len(init)])
    _, name = _compat.unique_graph_id(mode, prefix="scan_combine_graph")
    mode.tracer.root.register_module(name, body)
    args = (body, list(init), list(xs), tuple(additional_inputs))
    proxy_args = pytree.tree_map(mode.tracer.unwrap_proxy, args)
    out_proxy = mode.tracer.create_proxy("call_function", scan_op, proxy_args, {}, name="scan")
    with _compat.disable_proxy_modes_tracing():
        # a tuple: torch.export's serializer only knows tuple outputs of HOPs
        out = tuple(scan_op(body, list(init), list(xs), tuple(additional_inputs)))
    return _compat.track_tensor_tree(out, out_proxy, constant=None, tracer=mode.tracer)


@scan_op.py_impl(_compat.ProxyTorchDispatchMode)
def scan_proxy(mode, combine_fn, init, xs, additional_inputs, *, reverse=False, remat=None, unroll=1):
    if not reverse:
        return emit_scan_node(mode, combine_fn, init, xs, additional_inputs)
    with mode:
        xs = [torch.flip(x, [0]) for x in xs]
    out = emit_scan_node(mode, combine_fn, init, xs, additional_inputs)
    carry, ys = split_out(out, len(init))
    with mode:
        return tuple(carry + [torch.flip(y, [0]) for y in ys])
