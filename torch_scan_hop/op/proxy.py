"""ProxyTorchDispatchMode: make_fx records ONE scan node with the body as a subgraph.

The emitted node has upstream's positional form, because inductor's
``decompose_scan_to_while_loop`` and the exporters read it positionally. The
one kwarg kept is ``reverse=True`` for a compiler (our inductor pass lowers it
in place, see ``inductor_lowering``); for export a reverse scan becomes a scan
over reversed step indices whose body gathers its slices (ys flipped after).
The loop is laid out by ``schedule.segments``: one scan node per segment
(``unroll=k`` blocks run by a k-step body, then a remainder scan), no node
for a scan without steps; ``remat`` was consumed by the autograd rule.
"""
import contextlib

import torch

from .. import _compat
from .._compat import pytree
from ..core.op_args import example_args, split_out
from ..core.schedule import block_order, segments
from ..inductor import lowering as inductor_lowering
from ..core.checks import check_flat_carry, check_graph_mutation
from ..trace.effects import without_effectful_checks
from ..trace.peephole import views_to_reshapes
from .hop import scan_op
from .loop import carry_after_no_step, empty_ys


def trace_body(combine_fn, init, xs, additional_inputs):
    with _compat.disable_proxy_modes_tracing():
        args = example_args(init, xs, additional_inputs)
    body = _compat.reenter_make_fx(without_effectful_checks(combine_fn))(*args)
    views_to_reshapes(body.graph)
    body.recompile()
    return body


def _body_outputs(body):
    (out,) = body.graph.find_nodes(op="output")[0].args
    return [n.meta["val"] for n in out]


class ScanWithBody:
    """``scan_op`` with its body bound: the node target used for XLA tensors.

    torch_xla's Dynamo bridge (backend="openxla") partitions the graph and
    passes every non-call node feeding a fused region as an argument; a body
    GraphModule (the usual ``get_attr`` first argument) is rejected there. With
    the body inside the target, the node's inputs are tensors only.
    """

    __name__ = __qualname__ = "scan_with_body"

    def __init__(self, body):
        self.body = body

    def __call__(self, init, xs, additional_inputs):
        return tuple(scan_op(self.body, init, xs, additional_inputs))


def _add_dummy_y(body, carry_val):
    """Inductor's scan->while_loop rewrite fails on a scan without ys (its
    output is not unpacked as a tuple); one scalar per step avoids that."""
    device = carry_val.device
    out = body.graph.find_nodes(op="output")[0]
    with body.graph.inserting_before(out):
        dummy = body.graph.call_function(torch.ops.aten.zeros.default, ([],), {"device": device})
    fake_mode = getattr(carry_val, "fake_mode", None)
    with _compat.disable_proxy_modes_tracing(), (fake_mode or contextlib.nullcontext()):
        dummy.meta["val"] = torch.zeros((), device=device)  # exporters need a val on every node
    out.args = (list(out.args[0]) + [dummy],)
    body.recompile()


def _aliases_an_input(node):
    """The node is a body input, or a view of one (through view ops only)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False):
        node = node.args[0]
    return node.op == "placeholder"


def _copy_outputs_that_alias_inputs(body):
    """A body returning (a view of) its input, as a backward step does for the
    gradient of a carry the forward passes through unchanged, makes the loop's
    result that input's storage: inductor then asserts the result is aligned
    (an init that is a slice of a bigger buffer is not) and may reuse the
    init's storage for a later buffer. Such outputs get a copy."""
    out = body.graph.find_nodes(op="output")[0]
    values = list(out.args[0])
    aliased = [i for i, v in enumerate(values) if isinstance(v, torch.fx.Node) and _aliases_an_input(v)]
    if not aliased:
        return
    with body.graph.inserting_before(out):
        for i in aliased:
            copy = body.graph.call_function(torch.ops.aten.clone.default, (values[i],))
            val = values[i].meta["val"]
            with _compat.disable_proxy_modes_tracing(), (getattr(val, "fake_mode", None) or contextlib.nullcontext()):
                copy.meta["val"] = val.clone()
            values[i] = copy
    out.args = (values,)
    body.recompile()


def _checked_body_outputs(body, init, xs):
    """The traced body's output values, after the checks every path gets."""
    with _compat.disable_proxy_modes_tracing():
        check_graph_mutation(body, len(init), len(xs))
    outputs = _body_outputs(body)
    check_flat_carry(init, outputs[: len(init)])
    return outputs


def emit_scan_node(mode, combine_fn, init, xs, additional_inputs, **kwargs):
    body = trace_body(combine_fn, init, xs, additional_inputs)
    outputs = _checked_body_outputs(body, init, xs)
    _copy_outputs_that_alias_inputs(body)
    if len(outputs) == len(init) and init:
        _add_dummy_y(body, outputs[0])
        return emit_scan_node_of(mode, body, init, xs, additional_inputs, **kwargs)[: len(init)]
    return emit_scan_node_of(mode, body, init, xs, additional_inputs, **kwargs)


def emit_scan_node_of(mode, body, init, xs, additional_inputs, **kwargs):
    """Record one scan node running the traced ``body``."""
    args = (list(init), list(xs), tuple(additional_inputs))
    if _compat.on_xla([*init, *xs]):
        target = ScanWithBody(body)
    else:
        _, name = _compat.unique_graph_id(mode, prefix="scan_combine_graph")
        mode.tracer.root.register_module(name, body)
        target, args = scan_op, (body, *args)
    proxy_args = pytree.tree_map(mode.tracer.unwrap_proxy, args)
    out_proxy = mode.tracer.create_proxy("call_function", target, proxy_args, kwargs, name="scan")
    # the node's output values only: no backward is traced for them (a joint
    # traced here, outside the tracer, cannot see the tracer's size symbols)
    with _compat.disable_proxy_modes_tracing(), _compat.AutoDispatchBelowAutograd():
        # a tuple: torch.export's serializer only knows tuple outputs of HOPs
        out = tuple(scan_op(body, list(init), list(xs), tuple(additional_inputs), **kwargs))
    return _compat.track_tensor_tree(out, out_proxy, constant=None, tracer=mode.tracer)


def _unrolled_body(combine_fn, num_carry, num_x, order):
    """One loop iteration = a block of ``len(order)`` body calls over x blocks,
    run in ``order`` (block positions); the block's ys stay in index order."""

    def body(*args):
        carry, blocks, rest = args[:num_carry], args[num_carry:num_carry + num_x], args[num_carry + num_x:]
        ys = [None] * len(order)
        for j in order:
            carry, ys[j] = split_out(combine_fn(*carry, *(b[j] for b in blocks), *rest), num_carry)
        return [*carry, *(torch.stack(col) for col in zip(*ys))]

    return body


def _segment_scan(mode, combine_fn, carry, xs, additional_inputs, seg, reverse):
    """One scan node for one schedule segment (``xs`` already cut to it): the
    plain body, or with ``seg.unroll`` > 1 a block body over x blocks."""
    kwargs = {"reverse": True} if reverse else {}
    nc = len(carry)
    if seg.unroll == 1:
        return split_out(emit_scan_node(mode, combine_fn, carry, xs, additional_inputs, **kwargs), nc)
    with mode:
        blocks = [x.reshape(seg.iterations, seg.unroll, *x.shape[1:]) for x in xs]
    body = _unrolled_body(combine_fn, nc, len(xs), block_order(seg.unroll, reverse))
    carry, ys = split_out(emit_scan_node(mode, body, carry, blocks, additional_inputs, **kwargs), nc)
    with mode:
        return carry, [y.reshape(seg.steps, *y.shape[2:]) for y in ys]


def _no_step_scan(mode, combine_fn, init, xs, additional_inputs):
    """A scan with no step (``loop.carry_after_no_step``: the op's copies of init) and empty
    ys, no node; the body is still traced for its checks and y metadata."""
    ys_vals = _checked_body_outputs(trace_body(combine_fn, init, xs, additional_inputs), init, xs)[len(init):]
    with mode:
        return (*carry_after_no_step(init, op=True), *empty_ys(ys_vals))


def _scheduled_scan(mode, combine_fn, init, xs, additional_inputs, unroll, reverse=False):
    """The scan as ``schedule.segments`` lays it out: one node per segment, in
    execution order (reverse ones as reverse=True nodes), each segment's ys
    put back in index order. A single segment covers all of xs (no slicing)."""
    segs = segments(xs[0].shape[0], unroll, reverse)
    if not segs:
        return _no_step_scan(mode, combine_fn, init, xs, additional_inputs)
    carry, pieces = list(init), []
    for seg in segs:
        if len(segs) == 1:
            seg_xs = xs
        else:
            with mode:
                seg_xs = [x[seg.start:seg.stop] for x in xs]
        carry, ys = _segment_scan(mode, combine_fn, carry, seg_xs, additional_inputs, seg, reverse)
        pieces.append((seg.start, ys))
    return (*carry, *_ys_in_index_order(mode, pieces))


def _ys_in_index_order(mode, pieces):
    """Each segment's ys, concatenated by the input indices they cover."""
    if len(pieces) == 1:
        return pieces[0][1]
    columns = zip(*(ys for _, ys in sorted(pieces, key=lambda p: p[0])))
    with mode:
        return [torch.cat(col) for col in columns]


def _indexed_body(combine_fn, num_carry, num_lifted):
    """The body of a scan over step indices: it gathers its x slices from the
    whole xs (passed after the lifted inputs) at the index it is given."""

    def body(*args):
        carry, idx = args[:num_carry], args[num_carry]
        lifted, full = args[num_carry + 1:num_carry + 1 + num_lifted], args[num_carry + 1 + num_lifted:]
        row = idx.reshape(1)
        return combine_fn(*carry, *(x.index_select(0, row).squeeze(0) for x in full), *lifted)

    return body


def _reverse_scan(mode, combine_fn, init, xs, additional_inputs, unroll):
    """Reverse as a forward scan over the indices L-1..0, gathering each step's
    slices: flipping xs would copy them all (in a training backward, every
    saved activation) before the loop starts. Only the ys are flipped."""
    length = xs[0].shape[0]
    with mode:
        idx = torch.arange(length - 1, -1, -1, device=xs[0].device)
    body = _indexed_body(combine_fn, len(init), len(additional_inputs))
    out = _scheduled_scan(mode, body, init, [idx], (*additional_inputs, *xs), unroll)
    carry, ys = split_out(out, len(init))
    with mode:
        return tuple(carry + [torch.flip(y, [0]) for y in ys])


@scan_op.py_impl(_compat.ProxyTorchDispatchMode)
def scan_proxy(mode, combine_fn, init, xs, additional_inputs, *, reverse=False, remat=None, unroll=1):
    on_xla = _compat.on_xla([*init, *xs])
    if not on_xla:
        inductor_lowering.install()  # inductor's lowering of reverse scans and its torch 2.9 workarounds
    if not reverse:
        return tuple(_scheduled_scan(mode, combine_fn, init, xs, additional_inputs, unroll))
    if on_xla:  # keep the plain form torch_xla's bridge knows: flips around the node
        with mode:
            xs = [torch.flip(x, [0]) for x in xs]
        carry, ys = split_out(_scheduled_scan(mode, combine_fn, init, xs, additional_inputs, unroll), len(init))
        with mode:
            return tuple(carry + [torch.flip(y, [0]) for y in ys])
    if _compat.is_exporting():
        return _reverse_scan(mode, combine_fn, init, xs, additional_inputs, unroll)
    return tuple(_scheduled_scan(mode, combine_fn, init, xs, additional_inputs, unroll, reverse=True))
