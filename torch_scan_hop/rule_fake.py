"""FakeTensorMode: output metadata from ONE fake run of the body, not N."""
import torch

from . import _compat
from ._op import example_args, scan_op, split_out
from ._trees import ScanError


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


@scan_op.py_impl(_compat.FakeTensorMode)
def scan_fake(mode, combine_fn, init, xs, additional_inputs, *, reverse=False, remat=None, unroll=1):
    with mode:
        length = xs[0].shape[0]
        new_carry, y_slices = split_out(combine_fn(*example_args(init, xs, additional_inputs)), len(init))
        check_body_carry(init, new_carry)
        ys = [torch.empty((length, *y.shape), dtype=y.dtype, device=y.device) for y in y_slices]
        return [c.clone() for c in new_carry] + ys
