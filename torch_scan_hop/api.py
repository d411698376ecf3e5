"""The user-facing ``scan``: pytrees, validation, closure lifting, eager fast path."""
import torch

from . import _cache, _compat
from ._lift import trace_and_lift
from ._op import example_args, scan_op
from ._trees import (
    ScanError, ScanInputs, check_carry, check_pair, flatten_y, prepare_inputs,
)
from .partition import REMAT
from .rule_dynamo import AUTO_UNROLL, dynamo_body
from .rule_eager import stack_column, stack_ys
from .rule_functionalize import mark_checked


class FlatBody:
    """``fn(carry, x) -> (carry, y)`` as the op's flat body ``(*carry, *x) -> [*carry, *y]``.

    Validates every call (structure, leaf types, carry shape/dtype) and
    remembers the y pytree spec for unflattening the stacked ys.
    """

    def __init__(self, fn, inputs: ScanInputs):
        self.fn, self.inputs, self.y_spec = fn, inputs, None

    def __call__(self, *args):
        inputs = self.inputs
        nc = inputs.num_carry
        carry = inputs.init_spec.unflatten(args[:nc])
        x = None if inputs.xs_spec is None else inputs.xs_spec.unflatten(args[nc:nc + inputs.num_x])
        new_carry, y = check_pair(self.fn(carry, x))
        carry_leaves = check_carry(new_carry, inputs)
        y_leaves, self.y_spec = flatten_y(y)
        return [*carry_leaves, *y_leaves]


def _check_options(fn, reverse, remat, unroll):
    if not callable(fn):
        raise ScanError(f"scan: fn must be callable as fn(carry, x) -> (new_carry, y), got {type(fn).__name__}.")
    if not isinstance(reverse, bool):
        raise ScanError(f"scan: reverse must be a bool, got {reverse!r}.")
    if not (callable(remat) or remat in REMAT):
        raise ScanError(f"scan: remat={remat!r} is not a policy; use one of {REMAT} or a partition function.")
    if unroll is not None and (not isinstance(unroll, int) or isinstance(unroll, bool) or unroll < 1):
        raise ScanError(f"scan: unroll must be None or an int >= 1, got {unroll!r}.")


def scan(fn, init, xs=None, *, length=None, reverse=False, dim=0, remat="save_all", unroll=None):
    """Loop ``fn(carry, x) -> (new_carry, y)`` over ``xs`` along ``dim``.

    Returns ``(final_carry, ys)`` with the ys stacked along dim 0 in input order
    (also when ``reverse=True``, as ``jax.lax.scan``). ``xs=None`` with
    ``length=N`` calls fn with ``x=None`` N times. Tensors fn closes over are
    lifted into the op's ``additional_inputs`` and receive gradients.
    ``remat`` picks what the backward saves ("save_all", "min_cut",
    "recompute_all" or a partition function); ``unroll`` is a hint for the XLA
    lowering (body calls per loop iteration), ignored in eager.
    """
    _check_options(fn, reverse, remat, unroll)
    inputs = prepare_inputs(init, xs, length, dim)
    if _compat.is_dynamo_compiling():  # rule_dynamo captures fn as a subgraph, closures lifted
        out = scan_op(dynamo_body(fn, inputs), inputs.init_leaves, inputs.xs_leaves, (),
                      reverse=reverse, remat=remat, unroll=AUTO_UNROLL if unroll is None else unroll)
        return inputs.init_spec.unflatten(out[:inputs.num_carry]), out[inputs.num_carry]
    if _can_run_fast_eager(inputs):
        result = _fast_eager(fn, inputs, reverse)
        if result is not None:
            return result
    flat_out, y_spec = _call_op(fn, inputs, reverse=reverse, remat=remat, unroll=unroll or 1)
    nc = inputs.num_carry
    carry = inputs.init_spec.unflatten(flat_out[:nc])
    return carry, y_spec.unflatten(flat_out[nc:])


def _call_op(fn, inputs, **kwargs):
    """Run the op on the flat inputs; returns (flat outputs, y spec)."""
    init, xs = inputs.init_leaves, inputs.xs_leaves
    if not _compat.under_make_fx() and any(_compat.is_functional(t) for t in (*init, *xs)):
        # Under torch.func.functionalize in eager make_fx cannot see through
        # the wrappers; the Functionalize rule unwraps and runs the body directly.
        body = FlatBody(fn, inputs)
        return scan_op(body, init, xs, (), **kwargs), body.y_spec
    gm, lifted, y_spec = _traced_body(fn, inputs)
    return scan_op(gm, init, xs, tuple(lifted), **kwargs), y_spec


def _traced_body(fn, inputs):
    """The lifted body graph, from the cache when fn and the input metadata match."""
    cacheable = not _compat.dispatch_modes_active() and not _compat.under_make_fx()
    found = _cache.body_key(fn, inputs) if cacheable else None
    if found is not None:
        hit = _cache.lookup_traced(found[0])
        if hit is not None:
            return hit
    body = FlatBody(fn, inputs)
    with _compat.disable_proxy_modes_tracing():
        args = example_args(inputs.init_leaves, inputs.xs_leaves, ())
    gm, lifted = trace_and_lift(body, args)
    if not _compat.under_make_fx():  # checked once here, on the graph we already have
        mark_checked(gm, inputs.num_carry, inputs.num_x)
    if found is not None:
        _cache.store_traced(found[0], found[1], gm, lifted, body.y_spec)
    return gm, lifted, body.y_spec


def _can_run_fast_eager(inputs):
    """Plain tensors, no tracing: the op would only dispatch to its eager loop."""
    if _compat.is_dynamo_compiling() or _compat.dispatch_modes_active() or inputs.length == 0:
        return False
    return all(_compat.is_plain_tensor(t) for t in (*inputs.init_leaves, *inputs.xs_leaves))


def _x_slices(inputs):
    if inputs.xs_spec is None:
        return [None] * inputs.length
    columns = [x.unbind(0) for x in inputs.xs_leaves]
    if len(columns) == 1 and inputs.xs_spec.is_leaf():
        return columns[0]
    return [inputs.xs_spec.unflatten(s) for s in zip(*columns)]


def _any_requires_grad(leaves):
    return any(t.requires_grad for t in leaves)


def _fast_eager(fn, inputs, reverse):
    """The eager loop straight on the user's pytrees, no tracing.

    Only valid when no gradient is needed. Closed-over tensors are invisible
    before running fn, so the first step doubles as the probe: if its outputs
    require grad, return None and let the traced, lifted path take over.
    Step 0 is checked in full; later steps only pay for what the loop must do
    anyway (shape changes later surface when the carry is re-checked at the end
    and when ys are stacked).
    """
    grad_on = torch.is_grad_enabled()
    if grad_on and _any_requires_grad(inputs.init_leaves + inputs.xs_leaves):
        return None
    x_slices = _x_slices(inputs)
    order = list(range(inputs.length - 1, -1, -1) if reverse else range(inputs.length))
    carry, y = check_pair(fn(inputs.init_spec.unflatten(inputs.init_leaves), x_slices[order[0]]))
    carry_leaves = check_carry(carry, inputs)
    y_leaves, y_spec = flatten_y(y)
    if grad_on and _any_requires_grad(carry_leaves + y_leaves):
        return None
    if y_spec.is_leaf():  # one tensor y: a flat list, stacked once
        ys = [y]
        for i in order[1:]:
            carry, y = _pair(fn(carry, x_slices[i]))
            ys.append(y)
    else:
        ys = [y_leaves]
        for i in order[1:]:
            carry, y = _pair(fn(carry, x_slices[i]))
            ys.append(_same_structure_y(y, y_spec))
    check_carry(carry, inputs)
    if reverse:
        ys.reverse()
    stacked = [stack_column(ys, 0)] if y_spec.is_leaf() else stack_ys(ys)
    return carry, y_spec.unflatten(stacked)


def _pair(out):
    if type(out) is not tuple or len(out) != 2:
        check_pair(out)
    return out


def _same_structure_y(y, y_spec):
    leaves, spec = flatten_y(y)
    if spec != y_spec:
        raise ScanError(f"scan: fn returned y with structure {spec} after {y_spec}; "
                        "y must have the same structure at every step.")
    return leaves
