"""Checks every path applies to a traced body, and the mark a checked graph carries.

Shared by the rules (fake, proxy, functionalize, autograd) and the front end,
so that no rule module imports another.
"""
import torch

from .. import _compat
from ..core.op_args import example_args
from ..core.trees import ScanError
from .graph import trace_graph


def check_body_carry(init, new_carry):
    """Direct callers of scan_op get the same carry check as the front end."""
    if len(new_carry) != len(init):
        raise ScanError(f"scan: the body returned {len(new_carry)} carry leaves for {len(init)} init leaves.")
    for i, (old, new) in enumerate(zip(init, new_carry)):
        if not isinstance(new, torch.Tensor) or new.shape != old.shape or new.dtype != old.dtype:
            got = f"{tuple(new.shape)}/{new.dtype}" if isinstance(new, torch.Tensor) else repr(new)
            raise ScanError(
                f"scan: carry leaf {i} changed across an iteration: got {got}, "
                f"init has {tuple(old.shape)}/{old.dtype}."
            )


def input_name(i, num_carry, num_x):
    if i < num_carry:
        return f"carry leaf {i}"
    if i < num_carry + num_x:
        return f"x leaf {i - num_carry}"
    return f"closed-over tensor {i - num_carry - num_x} (additional_inputs)"


def check_no_input_mutation(combine_fn, init, xs, additional_inputs):
    args = example_args(init, xs, additional_inputs)
    check_graph_mutation(trace_graph(combine_fn, args), len(init), len(xs))


def check_graph_mutation(gm, num_carry, num_x):
    """Raise if the traced body ``gm`` writes into one of its inputs."""
    mutated, _ = _compat.input_mutations_and_outputs(gm)
    if mutated:
        names = ", ".join(input_name(i, num_carry, num_x) for i in mutated)
        raise ScanError(mutation_message(names))


def mutation_message(names):
    return (f"scan: fn mutates its input in place ({names}). Scan bodies must be functional: "
            "use out-of-place ops (c = c + x, not c += x / c.add_(x)).")


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
