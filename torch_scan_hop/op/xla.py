"""XLA: the whole scan is one XLA While built around the body's HLO (xla.lower).

XLA tensors carry the Functionalize key, so the Functionalize rule has already
unwrapped them and checked the body for input mutation; Autograd ran before
that, so forward and backward scans both arrive here as plain scans.
"""
from .. import _compat
from ..xla.lower import scan_on_xla
from .hop import scan_op
from .loop import run_flat


@scan_op.py_impl(_compat.DispatchKey.XLA)
def scan_xla(combine_fn, init, xs, additional_inputs, *, reverse=False, remat=None, unroll=1):
    if xs[0].shape[0] == 0:  # no step: the loop's zero-length rule (loop.carry_after_no_step)
        return run_flat(combine_fn, list(init), list(xs), tuple(additional_inputs), False)
    return scan_on_xla(combine_fn, list(init), list(xs), tuple(additional_inputs), reverse, unroll)
