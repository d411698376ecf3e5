"""The dispatcher: dispatch keys, which modes and transforms are active, and
the operator / tensor internals the rules and caches inspect.

Names re-exported as they are (torch 2.9 to 2.15, same API on all):
``DispatchKey`` (``torch._C``), ``AutoDispatchBelowAutograd``
(``torch._C._AutoDispatchBelowAutograd``), ``TorchDispatchMode``
(``torch.utils._python_dispatch``; the eager remat replay's mode subclasses it).
"""
import contextlib

import torch
from torch._C import DispatchKey  # noqa: F401  (re-exported for the rules)
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .functorch import _functionalize_transform_active, _is_transform_wrapped, is_functorch_wrapped

AutoDispatchBelowAutograd = torch._C._AutoDispatchBelowAutograd
_peek_interpreter = torch._C._functorch.peek_interpreter_stack  # None: no torch.func transform


@contextlib.contextmanager
def functionalization_on():
    """Lift an enclosing exclusion of the Functionalize key for this block.

    A Functionalize rule redispatches with the key excluded. Code that must
    see torch_xla's own functionalization (views of XLA tensors are only right
    through it) re-enables the key here and restores the exclusion after.

    torch 2.9 to 2.15: ``torch._C``'s TLS key-set getters and
    ``_ForceDispatchKeyGuard`` are unchanged.
    """
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(DispatchKey.Functionalize)
    with torch._C._ForceDispatchKeyGuard(include, exclude):
        yield


def dispatch_modes_active():
    """A TorchDispatchMode (fake, proxy, functional...) is on the stack.

    torch 2.9 to 2.15: ``torch.utils._python_dispatch._len_torch_dispatch_stack``
    (no public equivalent)."""
    from torch.utils._python_dispatch import _len_torch_dispatch_stack

    return _len_torch_dispatch_stack() > 0


def tracing_modes_active():
    """A tracing mode is on the stack: fake, proxy or functional (torch's "infra"
    modes), or a pre-dispatch trace. Other modes (FlopCounterMode, selective
    checkpointing's caching modes, a user's logging mode) trace nothing: under them
    the scan is the loop, each body op passing through the mode as in a for loop.

    torch 2.9 to 2.15: ``TorchDispatchMode.is_infra_mode``, the stack getter of
    ``torch.utils._python_dispatch`` and ``torch._ops``' pre-dispatch stack."""
    if _len_torch_dispatch_stack_pre_dispatch() > 0:
        return True
    if torch._C._len_torch_dispatch_stack() == 0:  # the common case, without building the stack's list
        return False
    return any(getattr(m, "is_infra_mode", lambda: False)() for m in _get_current_dispatch_mode_stack())


def only_user_modes_active():
    """Dispatch modes are on the stack and none of them traces (see ``tracing_modes_active``)."""
    return dispatch_modes_active() and not tracing_modes_active()


def is_dynamo_compiling():
    """Dynamo is tracing this frame. Public on torch 2.9 to 2.15; kept here so the
    rules ask every "which tracer is on" question in one place."""
    return torch.compiler.is_dynamo_compiling()


def is_exporting():
    """torch.export is tracing, strict or not.

    Under Dynamo, torch 2.9 folds ``torch.compiler.is_exporting()`` to True even
    for torch.compile, and strict export runs Dynamo before setting its own
    flag; export's Dynamo config (no runtime asserts) is the reliable tell.
    torch 2.14 has the same config flag; the same test serves both.
    """
    if torch.compiler.is_dynamo_compiling():
        return bool(torch._dynamo.config.do_not_emit_runtime_asserts)
    return torch.compiler.is_exporting()


def is_functional(t):
    """Wrapped by a functionalization pass (torch.func.functionalize, a
    FunctionalTensorMode). XLA tensors are functional wrappers by construction
    (torch_xla's own functionalization); they are not counted here, nor is the
    level-0 wrapper an op's Functionalize rule puts on its XLA outputs (counted,
    a scan whose init was another scan's final carry ran its body untraced under
    grad: constants in the HLO, and XLA refused them).

    torch 2.9 to 2.15: ``torch._is_functional_tensor`` and functorch's wrapper
    test are unchanged."""
    if t.device.type == "xla":
        return isinstance(t, FunctionalTensor) or _is_transform_wrapped(t)
    return isinstance(t, FunctionalTensor) or torch._is_functional_tensor(t) or is_functorch_wrapped(t)


def _is_eager_tensor(t):
    if isinstance(t, (FakeTensor, FunctionalTensor)) or torch._is_functional_tensor(t):
        return False
    return t.is_cpu or t.is_cuda or t.device.type not in ("xla", "lazy")  # cheap properties first


def runs_eagerly(tensors):
    """No tracer (make_fx, fake mode, Dynamo, functionalization) is active (modes that
    trace nothing, e.g. FlopCounterMode, may be) and
    every tensor holds real data off XLA: the scan is the Python loop.
    torch.func's vmap/grad/jvp wrappers count as eager: the loop composes with them.

    torch 2.9 to 2.15: the mode stack, fake / functional tensor classes and the
    functorch interpreter stack it reads are the same on all."""
    if is_dynamo_compiling() or tracing_modes_active() or (
            _peek_interpreter() is not None and _functionalize_transform_active()):
        return False
    for t in tensors:  # a plain loop: all() over a generator costs more than the few checks
        if isinstance(t, torch.Tensor) and not _is_eager_tensor(t):
            return False
    return True


def on_xla(tensors):
    """Any tensor lives on an XLA device (torch_xla's tensors are plain
    ``torch.Tensor``s with device type "xla"; no torch_xla import needed)."""
    return any(t.device.type == "xla" for t in tensors)


def is_concrete(t):
    """A tensor with real data and static shape (plain, Parameter or XLA): safe to cache on.
    torch 2.9 to 2.15: FakeTensor (``torch._subclasses``) is the only fake class."""
    return (isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
            and all(type(d) is int for d in t.shape))


def has_kernel_for(qualified_name, key):
    """The operator ``qualified_name`` ("aten::add.Tensor") has a kernel
    registered for dispatch key ``key`` (a key name: "XLA", ...).

    The XLA body check asks which ops torch_xla lowers. torch 2.9 to 2.15:
    ``torch._C._dispatch_has_kernel_for_dispatch_key`` (no public equivalent)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, key)


def is_op_overload(target):
    """An FX node target that is one aten/custom operator overload (``aten.add.Tensor``).

    torch 2.9 to 2.15: ``torch._ops.OpOverload``; ``torch.ops`` has no public
    class to test against."""
    return isinstance(target, torch._ops.OpOverload)


def is_op_or_packet(target):
    """An operator overload or its packet (``aten.add`` / ``aten.add.Tensor``).
    torch 2.9 to 2.15: ``torch._ops.OpOverload`` / ``OpOverloadPacket``."""
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def op_schema(op):
    """The FunctionSchema of an operator overload (name, overload_name,
    arguments, is_mutable). torch 2.9 to 2.15: the ``_schema`` attribute."""
    return op._schema


def tensor_version(t):
    """The tensor's version counter (bumped by every in-place write): a cache
    keyed on a tensor's identity must also see its data change.
    torch 2.9 to 2.15: ``Tensor._version``."""
    return t._version


def storage_use_count(storage):
    """How many tensors (and Python storage objects) hold ``storage`` (an
    ``UntypedStorage``), this one included. torch 2.9 to 2.15:
    ``torch._C._storage_Use_Count(storage._cdata)`` (no public query)."""
    return torch._C._storage_Use_Count(storage._cdata)


def alias_storage(base, size, stride):
    """A new tensor on ``base``'s storage (from its start) with these sizes and
    strides, and ``base``'s dtype: not a view (no ``_base``, own version
    counter), like ``empty(0).set_(storage, 0, size, stride)`` but ~5x cheaper.
    The caller guarantees the storage is large enough. torch 2.9 to 2.15:
    ``torch._C._dynamo.guards._reinterpret_tensor`` (inductor's own
    ``reinterpret_tensor``)."""
    return torch._C._dynamo.guards._reinterpret_tensor(base, size, stride, -base.storage_offset())


def empty_strided(size, stride, dtype, device):
    """``torch.empty_strided`` without the Python binding's argument parsing on
    the CPU (~0.8 vs ~1.4 us). torch 2.9 to 2.15: ``torch._C._dynamo.guards._empty_strided_cpu``
    (what inductor's generated code calls)."""
    if device.type == "cpu":
        return torch._C._dynamo.guards._empty_strided_cpu(size, stride, dtype)
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def has_meta_kernel(op):
    """FakeTensor can run ``op`` without its real kernel: it has a Meta kernel, or a composite
    one (views, most ops defined by others). Without either, FakeTensor runs the real kernel
    on zeros, and refuses to when an input has a symbolic stride or offset (GRUCell's
    ``aten._thnn_fused_gru_cell`` on CUDA, ``aten._standard_gamma_grad``).

    torch 2.9 to 2.15: ``torch._C._dispatch_has_kernel_for_dispatch_key`` (the registered
    kernels, not the computed table, which also counts fallbacks that raise)."""
    name = op.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in _FAKE_CAPABLE_KEYS)


_FAKE_CAPABLE_KEYS = ("Meta", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional",
                      "CompositeImplicitAutograd")
