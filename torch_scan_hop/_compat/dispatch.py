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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .functorch import _functionalize_transform_active, _is_transform_wrapped

AutoDispatchBelowAutograd = torch._C._AutoDispatchBelowAutograd


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


def torch_function_modes_depth():
    """How many torch-function modes are on (``torch._C._len_torch_function_stack``, 2.9 to 2.15)."""
    return torch._C._len_torch_function_stack()


def pop_torch_function_mode():
    """The innermost torch-function mode, popped off the stack (``torch._C._pop_torch_function_stack``)."""
    return torch._C._pop_torch_function_stack()


def push_torch_function_mode(mode):
    """``mode`` pushed as the innermost torch-function mode (``torch._C._push_on_torch_function_stack``)."""
    torch._C._push_on_torch_function_stack(mode)


def pre_dispatch_modes_depth():
    """How many pre-dispatch modes (a pre-dispatch trace) are on. torch 2.9 to 2.15:
    ``torch._ops._len_torch_dispatch_stack_pre_dispatch``."""
    return _len_torch_dispatch_stack_pre_dispatch()


def dispatch_modes_depth():
    """How many TorchDispatchModes are on (``torch._C._len_torch_dispatch_stack``)."""
    return torch._C._len_torch_dispatch_stack()


def dispatch_mode_stack():
    """The TorchDispatchModes on the stack, bottom first (``_get_current_dispatch_mode_stack``)."""
    return _get_current_dispatch_mode_stack()


def is_functional_tensor(t):
    """A functional wrapper (every XLA tensor is one). torch 2.9 to 2.15: ``torch._is_functional_tensor``."""
    return torch._is_functional_tensor(t)


peek_interpreter = torch._C._functorch.peek_interpreter_stack  # None: no torch.func transform
functionalize_transform_active = _functionalize_transform_active
is_transform_wrapped = _is_transform_wrapped


def current_modes_disabled():
    """A context with no TorchDispatchMode on (torch 2.9 to 2.15:
    ``torch.utils._python_dispatch._disable_current_modes``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def tensor_str_module():
    """The module ``torch._tensor_str``, whose ``_str`` ``Tensor.__repr__`` looks up when it runs
    (torch 2.9 to 2.15: ``_str`` around ``_str_intern``)."""
    from torch import _tensor_str

    return _tensor_str


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


def storage_identity(t):
    """A key equal for two tensors exactly when they share a storage, fake tensors included
    (``_base`` is not set on views that a decomposition rebuilt, a ``reshape`` of a contiguous
    value, say). torch 2.9 to 2.15: ``UntypedStorage._cdata`` (the StorageImpl's address)."""
    return t.untyped_storage()._cdata


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
