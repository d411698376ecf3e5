"""A body traced for its input-mutation check, and the mark a checked graph carries.

The checks and their messages are ``core/checks.py``'s; here is what needs a trace. Shared by
the rules (fake, proxy, functionalize, autograd) and the front end, so that no rule module
imports another.
"""
from .. import _compat
from ..core.checks import check_graph_mutation
from ..core.op_args import example_args
from .graph import forget_constants, outer_grad_mode_recorders_suspended, trace_graph


def check_no_input_mutation(combine_fn, init, xs, additional_inputs):
    args = example_args(init, xs, additional_inputs)
    gm = trace_graph(combine_fn, args)
    try:
        check_graph_mutation(gm, len(init), len(xs))
    finally:
        forget_constants(gm)


_CHECKED = "_torch_scan_hop_no_input_mutation"  # attribute set on a graph known not to mutate its inputs
_WRITES = "_torch_scan_hop_written_inputs"  # the inputs a graph writes into, where found


def mark_checked(gm, num_carry, num_x):
    """Check a body graph for input mutation now (no re-trace) and remember it passed."""
    if getattr(gm, _WRITES, None) != []:  # not known (``writes_only_carries``) to write into none
        check_graph_mutation(gm, num_carry, num_x)
    setattr(gm, _CHECKED, True)


def mark_functional(gm):
    """Graphs built by this package from functional graphs (the autograd step graphs)."""
    setattr(gm, _CHECKED, True)
    return gm


def is_checked(fn):
    return getattr(fn, _CHECKED, False)


def writes_only_carries(gm, num_carry):
    """Does ``gm`` write into some of its carry inputs (its first ``num_carry``) in place, and into
    no other input? Such a body is traced again on copies of its carries (``flat_body.copied_carries``);
    writes into an x slice or a closed-over tensor stay refused by ``check_graph_mutation``."""
    with outer_grad_mode_recorders_suspended():  # the check runs gm: its no_grad is not the outer graph's
        mutated, _ = _compat.input_mutations_and_outputs(gm)
    setattr(gm, _WRITES, list(mutated))
    return bool(mutated) and all(i < num_carry for i in mutated)


_LEAF_WRITE = "a leaf Variable that requires grad is being used in an in-place operation"


def is_leaf_write_error(e):
    """Did tracing fail on an in-place write into an input that requires grad (a traced body's inputs
    are leaves)? For a carry, what tracing on copies of the carries takes away."""
    return _LEAF_WRITE in f"{e} {getattr(e, 'msg', '')}"


def written_inputs(gm):
    """The inputs ``writes_only_carries`` found ``gm`` writing into ([] when not asked)."""
    return getattr(gm, _WRITES, None) or []
