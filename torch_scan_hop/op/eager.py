"""CompositeExplicitAutograd: the loop, below autograd (no gradient is recorded).

Reached when no gradient is needed, and for every step graph the autograd rule
runs. With gradients in plain eager the autograd rule runs the same loop ON
the tape instead (``loop.run_flat``).
"""
from .. import _compat
from .hop import scan_op
from .loop import run_flat


@scan_op.py_impl(_compat.DispatchKey.CompositeExplicitAutograd)
def scan_dense(combine_fn, init, xs, additional_inputs, *, reverse=False, remat=None, unroll=1):
    return run_flat(combine_fn, list(init), list(xs), tuple(additional_inputs), reverse)
