"""Dynamo's example values of a scan: the outputs' metadata, without an autograd plan.

When Dynamo records a scan node it runs the op once on fake inputs, only to learn its
outputs' shapes, dtypes and which of them require grad. Through the Autograd rule that
run would trace the body's joint and partition it (``build_plan``), and AOTAutograd then
does it all again in its own fake mode: for a scan nested in another's body, the inner
plan was built inside every speculation of the outer body. Here, while the tracker asks
(``asking``), the op runs below autograd and its outputs are marked differentiable as
the loop's would be after ``length`` steps (``differentiable``), read off the body graph
Dynamo just speculated.
"""
import contextlib
import threading

import torch

from .. import _compat

_state = threading.local()


@contextlib.contextmanager
def asking():
    """The Dynamo tracker is computing a scan node's example value (``call_and_unflatten``)."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def applies(combine_fn, flat):
    """Whether this Autograd call is Dynamo's example-value run of a body it speculated (a
    GraphModule with its example values). Tensors a torch.func transform wraps keep the
    full rule: the transform's levels decide their grads."""
    return (getattr(_state, "on", False) and isinstance(combine_fn, torch.fx.GraphModule)
            and not any(isinstance(t, torch.Tensor) and _compat.is_functorch_wrapped(t) for t in flat))


def run(scan_op, combine_fn, init, xs, additional_inputs, reverse, unroll):
    """The op's outputs below autograd, differentiable where the loop's would be."""
    flat = [*init, *xs, *additional_inputs]
    length = xs[0].shape[0] if xs else 0
    flags = differentiable(combine_fn, [isinstance(t, torch.Tensor) and t.requires_grad for t in flat],
                           len(init), length)

    def below():
        with _compat.AutoDispatchBelowAutograd():
            return scan_op(combine_fn, init, xs, additional_inputs, reverse=reverse, unroll=unroll)

    return list(_Marked.apply(below, flags, *flat))


class _Marked(torch.autograd.Function):
    """Outputs with a grad_fn (not leaves: user code may write into them in place) where
    ``flags`` says, non-differentiable elsewhere. Never differentiated: an example value."""

    @staticmethod
    def forward(ctx, below, flags, *flat):
        outs = below()
        ctx.mark_non_differentiable(*[o for o, f in zip(outs, flags) if isinstance(o, torch.Tensor) and not f])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("torch_scan_hop: a Dynamo example value of a scan was differentiated")


def differentiable(gm, in_flags, num_carry, length):
    """Per output of the scan (carries, then ys): does it require grad after ``length`` steps.

    The carries follow their orbit step by step (a body may drop a carry's grad: ``c = x.detach()``,
    or give it one a step later); the orbit of a few booleans repeats soon, so a long length costs
    no more than its cycle. A stacked y requires grad when any step's does. A symbolic length, and
    ys of a zero-length scan, take the flags every step could reach."""
    nc = num_carry
    rest = list(in_flags[nc:])
    carries = tuple(in_flags[:nc])
    if not isinstance(length, int):
        seen_y, state = None, carries
        for _ in range(nc + 2):
            out = _output_flags(gm, [*state, *rest])
            seen_y = _or(seen_y, out[nc:])
            grown = tuple(a or b for a, b in zip(state, out[:nc]))
            if grown == state:
                break
            state = grown
        return [*state, *seen_y]
    seen_y, state, visited = None, carries, {}
    for k in range(length):
        if state in visited:  # the orbit cycles: every state up to `length` has been seen
            cycle = list(visited)[visited[state]:]
            state = cycle[(length - k) % len(cycle)]
            break
        visited[state] = k
        out = _output_flags(gm, [*state, *rest])
        seen_y = _or(seen_y, out[nc:])
        state = tuple(out[:nc])
    if seen_y is None:  # no step ran: init's carries; the ys as any step could make them
        seen_y = differentiable(gm, in_flags, nc, None)[nc:]
    return [*state, *seen_y]


def _or(a, b):
    return list(b) if a is None else [x or y for x, y in zip(a, b)]


def _output_flags(gm, in_flags):
    """Which outputs of the speculated body require grad when its inputs do as ``in_flags``.
    A node requires grad when any of its inputs does and its example value (recorded with the
    carries at their fixed point, where the most require grad) does; a node with no tensor input
    or an explicit ``requires_grad_`` keeps its example value's flag; a node added after the
    speculation (no example value) follows its inputs."""
    flags = {}
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, f in zip(placeholders, in_flags):
        flags[node] = f
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            return [flags.get(o, False) if isinstance(o, torch.fx.Node) else False for o in _leaves(node.args[0])]
        inputs = node.all_input_nodes
        reached = any(flags.get(a, False) for a in inputs)
        if "example_value" not in node.meta:
            flags[node] = reached
            continue
        own = any(isinstance(v, torch.Tensor) and v.requires_grad
                  for v in _leaves(node.meta["example_value"]))
        keeps = not inputs or (node.op == "call_method" and node.target == "requires_grad_")
        flags[node] = own if keeps else own and reached
    return []


def _leaves(value):
    """A node's value or the output's args, tuples and lists flattened."""
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]
