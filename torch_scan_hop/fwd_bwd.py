"""``fwd_bwd``: the partitioned forward and backward graphs of one step, for users.

This is the stable contract PyTorch/XLA users asked for (see trace/partition.py for
the signatures): the argument order is the function's own flattened order,
closures are explicit trailing inputs (``FwdBwd.lifted``), and the pytree
specs map every flat argument back to the user's structure.
"""
from .api import FlatBody
from .core.remat import validated
from .core.trees import ScanInputs, flatten, require_tensor_leaves
from .trace.lift import trace_and_lift
from .trace.partition import FwdBwd, _differentiable, partition_body


def fwd_bwd(fn, carry, x=None, *, remat="save_all") -> FwdBwd:
    """Trace ``fn(carry, x) -> (new_carry, y)`` for ONE step and partition it.

    ``x`` is a single slice (not stacked). Every floating-point input gets a
    gradient output in ``bwd``. Returns a ``FwdBwd`` whose ``fwd``/``bwd`` are
    GraphModules, with ``lifted`` (closed-over tensors, in placeholder order),
    ``carry_spec``, ``x_spec`` and ``y_spec``.
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
