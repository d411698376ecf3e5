"""``fwd_bwd``: the partitioned forward and backward graphs of one step, for users.

This is the stable contract PyTorch/XLA users asked for (see trace/partition.py for
the signatures): the argument order is the function's own flattened order,
closures are explicit trailing inputs (``FwdBwd.lifted``), and the pytree
specs map every flat argument back to the user's structure.
"""
from collections.abc import Callable
from typing import Any

from .api import FlatBody
from .core.trees import ScanInputs, flatten, require_tensor_leaves
from .remat.policies import Remat, validated
from .trace.lift import trace_and_lift
from .trace.partition import FwdBwd, _differentiable, partition_body


def fwd_bwd(fn: Callable[[Any, Any], tuple[Any, Any]], carry: Any, x: Any = None, *,
            remat: Remat = "save_all") -> FwdBwd:
    """Trace ``fn(carry, x) -> (new_carry, y)`` for ONE step and partition it into graphs.

    What a traced scan runs per step, handed to users who drive their own loop (PyTorch/XLA's
    ask): the forward saves what ``remat`` keeps, the backward recomputes the rest.

    Args:
        fn: the step, as ``scan``'s ``fn``.
        carry: one carry pytree of tensors (as ``scan``'s ``init``).
        x: ONE slice of the xs (not stacked), a pytree of tensors, or None.
        remat: what ``fwd`` saves for ``bwd``, as ``scan``'s ``remat``.

    Returns:
        A ``FwdBwd``: ``fwd(*flat_carry, *flat_x, *lifted) -> (*flat_new_carry, *flat_y,
        *saved)`` and ``bwd(*saved, *grad_flat_new_carry, *grad_flat_y) -> (*grad_flat_carry,
        *grad_flat_x, *grad_lifted)`` as GraphModules (every floating-point input gets a
        gradient), ``lifted`` (the closed-over tensors, in placeholder order), ``carry_spec``,
        ``x_spec``, ``y_spec`` and ``saved_from``.

    Raises:
        ScanError: a non-tensor leaf in ``carry`` or ``x``, a bad ``remat``, or a body breaking
            ``scan``'s contract.

    Example:
        >>> import torch
        >>> from torch_scan_hop import fwd_bwd
        >>> W = torch.randn(4, 4, requires_grad=True)
        >>> fb = fwd_bwd(lambda h, x: (torch.tanh(h @ W + x), h.sum()), torch.zeros(2, 4), torch.randn(2, 4))
        >>> [t is W for t in fb.lifted]
        [True]
    """
    remat = validated(remat, "fwd_bwd")
    require_tensor_leaves(carry, "carry", "carry")
    require_tensor_leaves(x, "x", "x")
    carry_leaves, carry_spec = flatten(carry)
    x_leaves, x_spec = flatten(x)
    inputs = ScanInputs(carry_leaves, carry_spec, x_leaves, None if x is None else x_spec, 1)
    body = FlatBody(fn, inputs)
    examples = [t.detach() for t in (*carry_leaves, *x_leaves)]
    gm, lifted = trace_and_lift(body, examples)
    flat = [*carry_leaves, *x_leaves, *lifted]
    requires_grad = [_differentiable(t) for t in flat]  # every float input gets a gradient
    fb = partition_body(gm, examples[: len(carry_leaves)], examples[len(carry_leaves):],
                        lifted, requires_grad, remat)  # partition_body detaches its examples
    fb.lifted, fb.carry_spec, fb.x_spec, fb.y_spec = lifted, carry_spec, inputs.xs_spec, body.y_spec
    return fb
