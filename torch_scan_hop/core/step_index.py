"""``scan(..., with_index=True)``: the step index as one more xs leaf.

The body gets ``fn(carry, x, i)`` with ``i`` a 0-d int64 tensor: the index into xs of the slice
being processed (``reversed(range(T))`` order for ``reverse=True``, as the Python loop over it).
It is a slice of an internal ``arange(T)`` scanned with xs, so every path (the eager loop,
make_fx, Dynamo, export, XLA) computes it with no machinery of its own; the body never reads
its value as a Python number (``trace.indexing`` makes ``buf[:, i]`` a traced index).
"""
import functools

import torch

from .trees import ScanInputs, flatten


def _with_x_and_index(fn, carry, x_and_index):
    x, i = x_and_index
    return fn(carry, x, i)


def _with_index_only(fn, carry, i):
    return fn(carry, None, i)


def _arange(length, device):
    """``arange(length)`` on ``device``. On XLA made on the CPU and moved: torch_xla 2.9 builds
    ``torch.arange`` on the host element by element (5.6 ms for 16384 steps, 0.35 us per step of
    every call, more than the step of a small RNN; ``benchmarks/row_writes.py``), the CPU's
    arange and the copy take 0.18 ms."""
    if torch.device(device).type == "xla":
        return torch.arange(length, dtype=torch.int64).to(device)
    return torch.arange(length, dtype=torch.int64, device=device)


def with_step_index(fn, inputs: ScanInputs):
    """``(fn2, inputs2)``: ``fn2(carry, x2)`` calls ``fn(carry, x, i)``, ``inputs2`` has the index leaf."""
    device = inputs.xs_leaves[0].device  # xs=None: the zero-width stand-in, on init's device
    index = _arange(inputs.length, device)
    if inputs.xs_spec is None:  # the stand-in is replaced: the index carries the length
        return (functools.partial(_with_index_only, fn),
                ScanInputs(inputs.init_leaves, inputs.init_spec, [index], flatten(index)[1], inputs.length))
    leaves, spec = flatten((inputs.xs_spec.unflatten(inputs.xs_leaves), index))
    return functools.partial(_with_x_and_index, fn), ScanInputs(inputs.init_leaves, inputs.init_spec, leaves, spec,
                                                                inputs.length)
