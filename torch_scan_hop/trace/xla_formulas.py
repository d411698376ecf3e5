"""Autograd formulas for torch_xla custom ops that ship without one.

torch_xla keeps the backward of some ops in an autograd.Function around them:
``XLAPatchedLinear`` (``EinsumLinear``) calls ``xla::einsum_linear_forward``,
``MarkShardingFunction`` (``mark_sharding_with_gradients``) calls
``xla::aot_mark_sharding``. A scan body is traced to an aten graph, where the
Function is gone and only the op remains, so differentiating the body failed
with "no autograd formula was registered". Here each op gets its Function's
own backward, once, and only where torch_xla has not registered one.
"""
import contextlib
import sys

import torch

from .. import _compat

_done = False


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias)


def _linear_backward(ctx, grad):
    """XLAPatchedLinear.backward."""
    x, weight, bias = ctx.saved_tensors
    needs = ctx.needs_input_grad
    return torch.ops.xla.einsum_linear_backward(
        grad, x, weight, bias, needs[0], needs[1], bias is not None and needs[2])


def _sharding_setup(ctx, inputs, output):
    _, ctx.mesh, ctx.partition_spec = inputs


def _sharding_backward(ctx, grad):
    """MarkShardingFunction.backward: the gradient gets the same sharding."""
    return torch.ops.xla.aot_mark_sharding(grad, ctx.mesh, ctx.partition_spec), None, None


_FORMULAS = {
    "xla::einsum_linear_forward": (_linear_backward, _linear_setup),
    "xla::aot_mark_sharding": (_sharding_backward, _sharding_setup),
}


def register_missing():
    """Give torch_xla's custom ops their Functions' formulas (cheap after the first call)."""
    global _done
    if _done or "torch_xla.distributed.spmd.xla_sharding" not in sys.modules:
        return
    for name, (backward, setup) in _FORMULAS.items():
        if _compat.custom_op_lacks_autograd(name):
            torch.library.register_autograd(name, backward, setup_context=setup)
    _done = True


def _linear_op(input, weight, bias=None):
    return torch.ops.xla.einsum_linear_forward(input, weight, bias)


def _sharding_op(tensor, mesh, partition_spec):
    return _compat.xla.aot_mark_sharding(tensor, str(mesh), str(partition_spec))


_FUNCTIONS = {"XLAPatchedLinear": _linear_op, "MarkShardingFunction": _sharding_op}


@contextlib.contextmanager
def functions_as_ops():
    """While a joint is traced from the user's body, torch_xla's Functions call
    their op directly: the op's registered formula (above) is their backward.
    Run as Functions, their backward would meet closures as real XLA tensors
    inside the fake trace (a Function's arguments bypass the closure stand-ins)."""
    module = sys.modules.get("torch_xla.distributed.spmd.xla_sharding")
    if module is None:
        yield
        return
    register_missing()
    patched = [(getattr(module, name), op) for name, op in _FUNCTIONS.items() if hasattr(module, name)]
    # A scan in the body re-enters this context: each exit restores what its entry found.
    before = [(cls, cls.__dict__.get("apply")) for cls, _ in patched]
    try:
        for cls, op in patched:
            cls.apply = staticmethod(op)
        yield
    finally:
        for cls, previous in before:
            if previous is None:
                del cls.apply  # back to autograd.Function.apply
            else:
                cls.apply = previous
