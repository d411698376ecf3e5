"""Which dispatch modes and tensors mean a tracer is at work, and so whether a scan is the loop.

``runs_eagerly`` is the test ``core.route`` decides the eager path by; ``only_user_modes_active``
lets the op run as the loop under modes that trace nothing (FlopCounterMode, a logging mode);
``is_functional`` tells a functionalization pass's wrappers from XLA's own. The mode stacks and
wrapper tests they read are ``_compat.dispatch``'s adapters.
"""
import torch

from .. import _compat
from .._compat import dispatch as _dispatch

_FakeTensor, _FunctionalTensor = _compat.FakeTensor, _compat.FunctionalTensor


def tracing_modes_active():
    """A tracing mode is on the stack: fake, proxy or functional (torch's "infra"
    modes), or a pre-dispatch trace. Other modes (FlopCounterMode, selective
    checkpointing's caching modes, a user's logging mode) trace nothing: under them
    the scan is the loop, each body op passing through the mode as in a for loop.

    ``TorchDispatchMode.is_infra_mode`` tells tracing modes from others."""
    if _dispatch.pre_dispatch_modes_depth() > 0:
        return True
    if _dispatch.dispatch_modes_depth() == 0:  # the common case, without building the stack's list
        return False
    return any(getattr(m, "is_infra_mode", lambda: False)() for m in _dispatch.dispatch_mode_stack())


def only_user_modes_active():
    """Dispatch modes are on the stack and none of them traces (see ``tracing_modes_active``)."""
    return _compat.dispatch_modes_active() and not tracing_modes_active()


def is_functional(t):
    """Wrapped by a functionalization pass (torch.func.functionalize, a
    FunctionalTensorMode). XLA tensors are functional wrappers by construction
    (torch_xla's own functionalization); they are not counted here, nor is the
    level-0 wrapper an op's Functionalize rule puts on its XLA outputs (counted,
    a scan whose init was another scan's final carry ran its body untraced under
    grad: constants in the HLO, and XLA refused them)."""
    if t.device.type == "xla":
        return isinstance(t, _FunctionalTensor) or _dispatch.is_transform_wrapped(t)
    return (isinstance(t, _FunctionalTensor) or _dispatch.is_functional_tensor(t)
            or _compat.is_functorch_wrapped(t))


def _is_eager_tensor(t):
    if isinstance(t, (_FakeTensor, _FunctionalTensor)) or _dispatch.is_functional_tensor(t):
        return False
    return t.is_cpu or t.is_cuda or t.device.type not in ("xla", "lazy")  # cheap properties first


def runs_eagerly(tensors):
    """No tracer (make_fx, fake mode, Dynamo, functionalization) is active (modes that
    trace nothing, e.g. FlopCounterMode, may be) and
    every tensor holds real data off XLA: the scan is the Python loop.
    torch.func's vmap/grad/jvp wrappers count as eager: the loop composes with them."""
    if _compat.is_dynamo_compiling() or tracing_modes_active() or (
            _dispatch.peek_interpreter() is not None and _dispatch.functionalize_transform_active()):
        return False
    for t in tensors:  # a plain loop: all() over a generator costs more than the few checks
        if isinstance(t, torch.Tensor) and not _is_eager_tensor(t):
            return False
    return True
