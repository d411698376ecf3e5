"""Functionalize: run the body functionalized; in-place mutation of inputs is an error.

Scan bodies are pure functions of (carry, x, closures) — that is what lets the
backward replay them and XLA put them in a While. A body that writes into its
carry, its x slice or a closed-over tensor is rejected with the index of the
offending input rather than silently functionalized into a different program.
"""
import torch

from .. import _compat
from ..trace import cache
from ..trace.body_checks import check_no_input_mutation, is_checked
from .hop import scan_op


def _checked_once(combine_fn, init, xs, additional_inputs):
    """check_no_input_mutation, memoized per body and input metadata (shapes, dtypes, devices,
    requires_grad): a body's graph and those decide what it writes. In plain eager (C++
    functionalization, e.g. XLA tensors) per call; under a trace, AOTAutograd's two passes over
    one graph (its metadata pass, then the graph's) check once: a body trace less, ~5% of a
    compiled forward's first call. Symbolic shapes (no hashable key) check every time."""
    if is_checked(combine_fn):
        return
    check = lambda: check_no_input_mutation(combine_fn, init, xs, additional_inputs) or True  # noqa: E731
    flat = [*init, *xs, *additional_inputs]
    cache.memo(combine_fn, ("no-input-mutation", cache.tensor_meta(flat, with_grad=True)), check)


def _unwrapped(ctx, tensors):
    """``ctx.unwrap_tensors(tensors)`` for a flat list. Under C++ functionalization (every eager
    call on XLA tensors, twice per training step) torch's own is a pytree map with per-tensor
    checks for wrapper kinds this API never holds: 80 us of the step's host time for a scan's
    ~5 inputs, against ~20 us for this loop of the same two calls per tensor (sync, unwrap)."""
    if not isinstance(ctx, _compat.CppFunctionalizeAPI) or any(
            isinstance(t, _compat.FunctionalTensor) for t in tensors):
        return ctx.unwrap_tensors(tensors)
    wrapped = _compat.dispatch.is_functional_tensor
    return [_compat.tracing.functional_value(t) if isinstance(t, torch.Tensor) and wrapped(t) else t for t in tensors]


@scan_op.py_functionalize_impl
def scan_functionalize(ctx, combine_fn, init, xs, additional_inputs, **kwargs):
    init, xs, additional_inputs = (_unwrapped(ctx, list(t)) for t in (init, xs, additional_inputs))
    with ctx.redispatch_to_next():
        _checked_once(combine_fn, init, xs, additional_inputs)
        if _compat.on_xla([*init, *xs]):
            # The XLA rule lowers the body on its own placeholder tensors, where
            # internal in-place ops are fine; keeping the body object lets it
            # cache the lowered While per body.
            body = combine_fn
        else:
            body = ctx.functionalize(_compat._maybe_run_with_interpreter(combine_fn))
        out = scan_op(body, init, xs, tuple(additional_inputs), **kwargs)
    if isinstance(ctx, _compat.CppFunctionalizeAPI) and _compat.on_xla(out):
        # wrapped as any XLA op's outputs are, not at level 0 (wrap_tensors): Dynamo cannot
        # fakify those, so a scan fed the previous scan's output failed its capture on every
        # call and was traced again every step (a scanned model's second scan)
        return [_compat.tracing.plain_functional_wrapper(t) for t in out]
    return ctx.wrap_tensors(out)
