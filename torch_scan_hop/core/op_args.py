"""The op's flat calling convention, as every rule and the front end see it.

``scan_op(combine_fn, init, xs, additional_inputs) -> [*final_carry, *ys]`` with
``combine_fn(*carry, *x_slice, *additional_inputs) -> [*new_carry, *y]``: the
examples a body is traced on once, and the split of its flat outputs.
"""
import torch

from .. import _compat
from .dtensors import is_dtensor, zero_slice


def split_out(flat_out, num_carry):
    return list(flat_out[:num_carry]), list(flat_out[num_carry:])


def slice_example(x):
    """A stand-in for one slice of ``x`` that also exists when ``x`` has length 0."""
    if is_dtensor(x):
        return zero_slice(x)
    return torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)


def example_args(init, xs, additional_inputs):
    """Inputs for tracing the body once: fresh carries, one x slice, the closures.

    Made outside any make_fx trace under way: a stand-in is never a node of the caller's
    graph (a trace of the body takes them as its own inputs). Recorded, the body's ops on
    them would compute values from stand-ins in the graph that runs the scan."""
    with _compat.disable_proxy_modes_tracing():
        return [*(c.clone() for c in init), *(slice_example(x) for x in xs), *additional_inputs]
