"""CompositeExplicitAutograd: the eager loop.

Slices come from one ``unbind`` per xs leaf and ys are stacked once at the end:
per step the loop costs one body call and a few list operations, which keeps
eager scan within a few percent of a hand-written Python loop.
"""
import torch

from . import _compat
from ._op import example_args, scan_op, split_out
from ._trees import ScanError


def run_loop(step, carry, x_slices, length, reverse):
    """Run ``step(carry, x) -> (carry, y_leaves)`` over ``x_slices``; stack ys.

    Returns ``(carry, per_step_y_leaves)`` with the ys in input order.
    """
    ys = []
    order = range(length - 1, -1, -1) if reverse else range(length)
    for i in order:
        carry, y = step(carry, x_slices[i])
        ys.append(y)
    if reverse:
        ys.reverse()
    return carry, ys


def stack_column(column, k):
    """One y leaf's per-step values -> one tensor (a clear error if shapes drift)."""
    try:
        return torch.stack(column)
    except (RuntimeError, TypeError) as e:
        kinds = sorted({(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                        for t in column}, key=str)
        raise ScanError(
            f"scan: y leaf {k} changed across iterations (saw {kinds}); each step must "
            "return ys of the same structure, shape and dtype."
        ) from e


def stack_ys(ys):
    return [stack_column(column, k) for k, column in enumerate(zip(*ys))]


def empty_ys(combine_fn, init, xs, additional_inputs):
    """ys of a zero-length scan: shapes from one fake run of the body."""
    num_carry = len(init)
    with _compat.fresh_fake_mode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                     for a in example_args(init, xs, additional_inputs)]
        _, y_meta = split_out(combine_fn(*fake_args), num_carry)
    return [torch.empty((0, *y.shape), dtype=y.dtype, device=y.device) for y in y_meta]


@scan_op.py_impl(_compat.DispatchKey.CompositeExplicitAutograd)
def scan_dense(combine_fn, init, xs, additional_inputs, *, reverse=False, remat=None, unroll=1):
    length = xs[0].shape[0]
    num_carry = len(init)
    if length == 0:
        return [c.clone() for c in init] + empty_ys(combine_fn, init, xs, additional_inputs)
    columns = [x.unbind(0) for x in xs]
    x_slices = list(zip(*columns))

    def step(carry, x):
        return split_out(combine_fn(*carry, *x, *additional_inputs), num_carry)

    carry, ys = run_loop(step, list(init), x_slices, length, reverse)
    return [*carry, *stack_ys(ys)]
