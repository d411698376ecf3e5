"""The front end's body as the op sees it under torch.compile: flat leaves in,
``[*carry_leaves, y_tree]`` out (``pytree_step``). Shared by the front end,
which builds it, and the Dynamo tracker, which reads its error constant.
"""
import functools

from ..core.checks import check_carry, check_pair
from ..core.trees import ScanError, ScanInputs

_ERROR = "__torch_scan_hop_error__"


def pytree_step(*flat, fn, inputs):
    """The body as Dynamo traces it: flat leaves in, ``[*carry_leaves, y_tree]`` out.

    A bad carry or return value comes back as the constants ``[_ERROR, message]``
    (an exception raised inside the speculated body would lose its message);
    the tracker raises it as a ScanError.
    """
    nc, nx = inputs.num_carry, inputs.num_x
    carry = inputs.init_spec.unflatten(flat[:nc])
    x = None if inputs.xs_spec is None else inputs.xs_spec.unflatten(flat[nc:nc + nx])
    try:
        new_carry, y = check_pair(fn(carry, x))
        leaves = check_carry(new_carry, _carry_inputs_as_init(inputs, flat[:nc]))
    except ScanError as e:
        return [_ERROR, e.args[0]]
    return [*leaves, y]


def _carry_inputs_as_init(inputs, carry_leaves):
    """The body's own carry inputs stand in for init in the carry check: they
    have init's shapes and dtypes, but reading the outer init tensors would make
    Dynamo lift them (and, under dynamic=True, their size symbols) into the
    subgraph's additional inputs: a closure requiring grad that the backward
    then differentiates every step."""
    return ScanInputs(list(carry_leaves), inputs.init_spec, [], inputs.xs_spec, inputs.length)


def dynamo_body(fn, inputs):
    return functools.partial(pytree_step, fn=fn, inputs=inputs)


def copied_carries(flat, num_carry):
    """The body's carry inputs as copies of their own: a body that writes into its carry in place
    (``c.mul_(a)``, ``buf[:, t] = h``) then writes into the copy, which functionalization turns
    into out-of-place ops whose results are the new carry (also when the body returns the
    written object itself). The op's inputs are never written."""
    return (*(c.clone() for c in flat[:num_carry]), *flat[num_carry:])


def rewritten_step(num_carry, step, *flat):
    """``step(*flat)`` (the op's flat body) on copies of its carries: what the Dynamo tracker
    retries a body with that writes into its carries."""
    return step(*copied_carries(flat, num_carry))
