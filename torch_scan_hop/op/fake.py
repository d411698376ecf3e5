"""FakeTensorMode: output metadata from ONE fake run of the body, not N."""
import torch

from .. import _compat
from ..core.checks import check_flat_carry
from ..core.op_args import example_args, split_out
from .hop import scan_op


@scan_op.py_impl(_compat.FakeTensorMode)
def scan_fake(mode, combine_fn, init, xs, additional_inputs, *, reverse=False, remat=None, unroll=1):
    with mode:
        length = xs[0].shape[0]
        new_carry, y_slices = split_out(combine_fn(*example_args(init, xs, additional_inputs)), len(init))
        check_flat_carry(init, new_carry)
        ys = [torch.empty((length, *y.shape), dtype=y.dtype, device=y.device) for y in y_slices]
        return [c.clone() for c in new_carry] + ys
