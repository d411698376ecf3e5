"""functorch's C++ transforms (vmap levels, batched tensors, the interpreter stack).

torch 2.9 to 2.15: ``torch._C._functorch`` and ``torch._functorch.pyfunctorch``
have the same functions on all; ``TransformType`` is re-exported as it is.
"""
import torch
from torch._C._functorch import TransformType  # noqa: F401  (re-exported for rule_functorch)


def functorch_level(t):
    """The vmap level of a batched tensor, else None (torch 2.9 to 2.15)."""
    f = torch._C._functorch
    return f.maybe_get_level(t) if f.is_batchedtensor(t) else None


def functorch_unwrap(t):
    """The tensor one functorch level below ``t`` (torch 2.9 to 2.15)."""
    return torch._C._functorch.get_unwrapped(t)


def functorch_bdim(t):
    """The batch dim of a batched tensor at its own level (torch 2.9 to 2.15)."""
    return torch._C._functorch.maybe_get_bdim(t)


def is_batched_here(t):
    """A tensor batched by some vmap level (torch 2.9 to 2.15)."""
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_batchedtensor(t)


def add_batch_dim(t, bdim, level):
    """Wrap ``t`` as batched along ``bdim`` at vmap ``level`` (torch 2.9 to 2.15)."""
    from torch._C._functorch import _add_batch_dim

    return _add_batch_dim(t, bdim, level)


def is_functorch_wrapped(t):
    """A functorch wrapper around ``t``: a vmap level's BatchedTensor or a
    grad/jvp/functionalize level's wrapper (torch 2.9 to 2.15: ``is_functorch_wrapped_tensor``)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def below_functorch_wrappers(t):
    """``t`` with every functorch wrapper taken off (the value a vmapped or grad-wrapped tensor
    stands for, whose version counter and storage a write reaches); ``t`` itself if it has none
    or is not a tensor."""
    while isinstance(t, torch.Tensor) and is_functorch_wrapped(t):
        t = functorch_unwrap(t)
    return t


def functorch_disabled_guard():
    """A guard object that excludes functorch's dispatch keys while it lives, restoring the
    state it was made in when it is freed (torch 2.9 to 2.15: ``torch._C._DisableFuncTorch``)."""
    return torch._C._DisableFuncTorch()


def _is_transform_wrapped(t):
    """Wrapped by a live torch.func transform (grad, vmap, jvp, functionalize): a
    functorch wrapper with a level. A higher-order op's Functionalize rule wraps its
    outputs at level 0 (``CppFunctionalizeAPI.wrap_tensors``), which is no transform:
    on XLA, whose tensors are functional wrappers anyway, such an output (a scan's
    final carry) is an ordinary tensor for the next op. torch 2.9 to 2.15: ``maybe_get_level``
    is -1 for no wrapper, 0 for that level-0 wrapper, >= 1 inside a transform."""
    return is_functorch_wrapped(t) and torch._C._functorch.maybe_get_level(t) > 0


def _interpreters():
    """The active torch.func transforms, outermost first
    (torch 2.9 to 2.15: ``retrieve_all_functorch_interpreters``)."""
    if torch._C._functorch.peek_interpreter_stack() is None:  # the common case, without building a list
        return []
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return retrieve_all_functorch_interpreters()


def _functionalize_transform_active():
    """torch.func.functionalize is on the functorch interpreter stack."""
    return any(i.key() == TransformType.Functionalize for i in _interpreters())


def functorch_transforms_active():
    """Any torch.func transform (vmap, grad, jvp, functionalize) is active."""
    return bool(_interpreters())


def differentiating_transform_active():
    """torch.func.grad / vjp / jvp (or jacrev, hessian...) is on the functorch
    interpreter stack."""
    return any(i.key() in (TransformType.Grad, TransformType.Jvp) for i in _interpreters())


def requires_grad_allowed():
    """A context where ``requires_grad_`` on a tensor no transform wraps is allowed while a
    transform is active: functorch refuses it then (meant for a user's own tensors), and
    Dynamo tracing ``vmap(f)`` has vmap active while scan marks its body's example carries.
    torch 2.9 and 2.15: ``torch._functorch.eager_transforms.enable_inplace_requires_grad``."""
    from torch._functorch.eager_transforms import enable_inplace_requires_grad

    return enable_inplace_requires_grad(True)


def forward_ad_disabled():
    """A context without forward-mode AD (jvp's and ``forward_ad.dual_level``'s tangents
    are not propagated): a zero-length scan's fake shape run needs no tangents, and
    torch's forward-AD formulas mix the ZeroTensor of an undefined tangent into meta
    arithmetic (``add_zerotensor`` / ``mul_zerotensor`` compute on ``.to("meta")``
    copies), which meets the fake mode's tensors as a "meta vs cpu" device error (a
    LayerNorm with a jvp-dual weight and a plain bias). torch 2.9 and 2.15:
    ``torch.autograd.forward_ad._set_fwd_grad_enabled`` (a context manager on all)."""
    from torch.autograd.forward_ad import _set_fwd_grad_enabled

    return _set_fwd_grad_enabled(False)


def is_vmap_inplace_error(e):
    """vmap's refusal of an in-place op on an unbatched tensor by a batched one. torch 2.9 to
    2.15 raise a RuntimeError whose text starts "vmap: inplace arithmetic" (``mul_``), or, for an
    op without a batching rule (``index_put_``: ``buf[t] = row``), says ``self`` is not vmapped; into
    an unbatched 0-d tensor it is the op's shape error ("output with shape [] doesn't match the
    broadcast shape [2]"). Callers retry unbatched, where an error of the body's own comes back."""
    text = str(e) if isinstance(e, RuntimeError) else ""
    return text.startswith("vmap: inplace arithmetic") or "doesn't match the broadcast shape" in text or (
        text.startswith("vmap: ") and "is not possible" in text and "`self` not being vmapped" in text)
