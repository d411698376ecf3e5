"""A body traced for its input-mutation check, and the mark a checked graph carries.

The checks and their messages are ``core/checks.py``'s; here is what needs a trace. Shared by
the rules (fake, proxy, functionalize, autograd) and the front end, so that no rule module
imports another.
"""
from ..core.checks import check_graph_mutation
from ..core.op_args import example_args
from .graph import trace_graph


def check_no_input_mutation(combine_fn, init, xs, additional_inputs):
    args = example_args(init, xs, additional_inputs)
    check_graph_mutation(trace_graph(combine_fn, args), len(init), len(xs))


_CHECKED = "_torch_scan_hop_no_input_mutation"  # attribute set on a graph known not to mutate its inputs


def mark_checked(gm, num_carry, num_x):
    """Check a body graph for input mutation now (no re-trace) and remember it passed."""
    check_graph_mutation(gm, num_carry, num_x)
    setattr(gm, _CHECKED, True)


def mark_functional(gm):
    """Graphs built by this package from functional graphs (the autograd step graphs)."""
    setattr(gm, _CHECKED, True)
    return gm


def is_checked(fn):
    return getattr(fn, _CHECKED, False)
