"""Every private torch API this package touches, in one place.

torch's HOP internals move between releases; keeping the imports and the thin
adapters here means a new torch version changes this file, not the rules.
"""
import contextlib

import torch
from torch._C import DispatchKey  # noqa: F401  (re-exported for the rules)
from torch._higher_order_ops.utils import (  # noqa: F401
    _from_fun,
    _maybe_run_with_interpreter,
    check_input_alias_and_mutation_return_outputs,
    materialize_as_graph,
    reenter_make_fx,
    unique_graph_id,
)
from torch._ops import HigherOrderOperator  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily  # noqa: F401
from torch._dispatch.python import suspend_functionalization
from torch._subclasses.functional_tensor import (  # noqa: F401
    CppFunctionalizeAPI,
    FunctionalTensor,
    disable_functional_mode,
)
from torch.fx.experimental import proxy_tensor as _proxy_tensor
from torch.fx.experimental.proxy_tensor import (  # noqa: F401
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    make_fx,
    track_tensor_tree,
)

AutoDispatchBelowAutograd = torch._C._AutoDispatchBelowAutograd


def install_as_upstream_scan(op):
    """Make ``torch.ops.higher_order.scan`` resolve to ``op``.

    The HOP registry and the ``torch.ops.higher_order`` namespace cache the
    first object under a name, so both must be overwritten (NOTES decision 1).
    """
    torch._ops._higher_order_ops["scan"] = op
    setattr(torch.ops.higher_order, "scan", op)


def under_make_fx():
    """True while a make_fx trace is running (so subgraphs must re-enter it)."""
    return _proxy_tensor._CURRENT_MAKE_FX_TRACER is not None


@contextlib.contextmanager
def functionalization_on():
    """Lift an enclosing exclusion of the Functionalize key for this block.

    A Functionalize rule redispatches with the key excluded. Code that must
    see torch_xla's own functionalization (views of XLA tensors are only right
    through it) re-enables the key here and restores the exclusion after.
    """
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(DispatchKey.Functionalize)
    with torch._C._ForceDispatchKeyGuard(include, exclude):
        yield


def dispatch_modes_active():
    from torch.utils._python_dispatch import _len_torch_dispatch_stack

    return _len_torch_dispatch_stack() > 0


def is_dynamo_compiling():
    return torch.compiler.is_dynamo_compiling()


def is_exporting():
    """torch.export is tracing, strict or not.

    Under Dynamo, torch 2.9 folds ``torch.compiler.is_exporting()`` to True even
    for torch.compile, and strict export runs Dynamo before setting its own
    flag; export's Dynamo config (no runtime asserts) is the reliable tell.
    """
    if torch.compiler.is_dynamo_compiling():
        return bool(torch._dynamo.config.do_not_emit_runtime_asserts)
    return torch.compiler.is_exporting()


def is_functional(t):
    """Wrapped by a functionalization pass (torch.func.functionalize, a
    FunctionalTensorMode). XLA tensors are functional wrappers by construction
    (torch_xla's own functionalization); they are not counted here."""
    if t.device.type == "xla":
        return isinstance(t, FunctionalTensor) or _is_functorch_wrapped(t)
    return isinstance(t, FunctionalTensor) or torch._is_functional_tensor(t) or _is_functorch_wrapped(t)


def _is_functorch_wrapped(t):
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def is_plain_tensor(t):
    """A real, non-wrapper tensor: what the eager fast path can run on."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and not isinstance(t, FunctionalTensor)
        and not torch._is_functional_tensor(t)
        and not _is_functorch_wrapped(t)
        and t.device.type != "xla"
    )


def on_xla(tensors):
    return any(t.device.type == "xla" for t in tensors)


def is_concrete(t):
    """A tensor with real data and static shape (plain, Parameter or XLA): safe to cache on."""
    return (isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
            and all(type(d) is int for d in t.shape))


def trace_graph(fn, args, *, force_enable_grad=False):
    """Trace ``fn(*args)`` to an aten GraphModule in whatever mode is active.

    Re-enters an outer make_fx trace (or fake mode) if there is one; on real
    tensors traces with a fresh fake mode, so nothing real is computed and
    closed-over real tensors become constants (which ``_lift`` turns into inputs).
    """
    if force_enable_grad:  # differentiating: torch_xla's custom ops need their formulas
        from ._xla_autograd import register_missing

        register_missing()
    if under_make_fx() or detect_fake_mode(args) is not None:
        return materialize_as_graph(fn, tuple(args), force_enable_grad=force_enable_grad)
    with contextlib.ExitStack() as stack:
        # Functional wrappers (torch.func.functionalize, XLA) would hide the
        # body from make_fx: trace on plain stand-ins of the same metadata.
        stack.enter_context(suspend_functionalization())
        stack.enter_context(disable_functional_mode())
        args = [_from_fun(a) for a in args]
        if force_enable_grad:
            stack.enter_context(torch.enable_grad())
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)


class _ClosureStandIns(torch.overrides.TorchFunctionMode):
    """Swaps closed-over functional tensors (every XLA tensor is one) for their
    unwrapped values as torch functions receive them, and remembers which is which.

    make_fx cannot trace through a functional wrapper it did not create: ops
    on it run below the tracer and their results come out untracked. The plain
    inner value traces like any constant; lifting then hands back the user's
    tensor, which keeps its autograd identity.
    """

    def __init__(self):
        super().__init__()
        self.outer, self._by_id, self._moved, self.xla = {}, {}, {}, None

    def _stand_in(self, t):
        if not (isinstance(t, torch.Tensor) and torch._is_functional_tensor(t)) \
                or isinstance(t, FakeTensor):
            return t
        hit = self._by_id.get(id(t))
        if hit is None:
            torch._sync(t)
            plain = torch._from_functional_tensor(t)  # its value, without the wrapper
            hit = self._by_id[id(t)] = (plain, t)
            self.outer[id(plain)] = t
        return hit[0]

    def _onto(self, device):
        """CPU tensors meeting XLA ones move to the device, as torch_xla moves
        them per op in eager (fake tracing rejects the mix): a traced value in
        the graph, a closure as a device copy standing in for it."""
        def onto(t):
            if not _cpu_array(t):
                return t
            if isinstance(t, FakeTensor):
                return t.to(device)
            if id(t) not in self._by_id:
                with unset_fake_temporarily(), disable_proxy_modes_tracing():
                    plain = self._stand_in(t.detach().to(device))  # unwrapped like an XLA closure
                self._by_id[id(t)] = (plain, t)
                self.outer[id(plain)] = t
            return self._by_id[id(t)][0]
        return onto

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tree_map = torch.utils._pytree.tree_map
        args, kwargs = tree_map(self._stand_in, (args, kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        xla = next((t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "xla"), None)
        self.xla = self.xla or xla
        if xla is not None and any(_cpu_array(t) for t in leaves):
            args, kwargs = tree_map(self._onto(xla), (args, kwargs))
        return func(*args, **kwargs)

    def lifted(self, t):
        """What the op receives for lifted constant t. A CPU closure that requires
        grad in a body on XLA becomes a differentiable copy on the device: its
        gradient comes back to it through the copy, and the body's backward
        stays on one device (autograd would run CPU nodes on another thread,
        both dispatching into one fake mode while partitioning)."""
        t = self.outer.get(id(t), t)
        if self.xla is None or t.device.type != "cpu" or not t.requires_grad or isinstance(t, FakeTensor):
            return t
        if id(t) not in self._moved:
            with disable_proxy_modes_tracing(), torch.enable_grad():
                self._moved[id(t)] = t.to(self.xla)
        return self._moved[id(t)]


def _cpu_array(t):
    """A CPU tensor with dims: fake tracing lets only 0-dim ones mix with XLA tensors."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0


@contextlib.contextmanager
def recording_functional_closures():
    """Yields ``outer(t)``: what the op receives for lifted constant t (the user's
    tensor that stand-in t replaced, else t itself)."""
    mode = _ClosureStandIns()
    with mode:
        yield mode.lifted


def fresh_fake_mode():
    return FakeTensorMode(allow_non_fake_inputs=True)


def detect_fake_mode(tensors):
    from torch._guards import detect_fake_mode as _detect

    return _detect(tensors)


def partitioner(name):
    from functorch.compile import default_partition, min_cut_rematerialization_partition

    return {"save_all": default_partition, "min_cut": min_cut_rematerialization_partition}[name]


def extract_fwd_bwd(joint, saved_values, num_fwd_outputs):
    """functorch's fwd/bwd extraction for a hand-chosen list of saved nodes."""
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    return _extract_fwd_bwd_modules(joint, saved_values, [], num_fwd_outputs=num_fwd_outputs)


def allow_scalar_outputs(shape_env):
    """Let this ShapeEnv produce unbacked scalars (what capture_scalar_outputs sets per frame)."""
    import dataclasses

    if shape_env is not None and not shape_env.settings.allow_scalar_outputs:
        shape_env.settings = dataclasses.replace(shape_env.settings, allow_scalar_outputs=True)


@contextlib.contextmanager
def eager_autograd_engine():
    """Run torch.autograd.grad inside our joint trace on the plain engine, even
    while compiled autograd is on (it would try to Dynamo-compile our trace)."""
    import sys

    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is None:
        yield
        return
    with ca._disable():
        yield
