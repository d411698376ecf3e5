"""Every private torch API this package touches, in one place.

torch's HOP internals move between releases; keeping the imports and the thin
adapters here means a new torch version changes this file, not the rules.
"""
import collections
import contextlib
import itertools
import threading

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


def input_mutations_and_outputs(gm):
    """(indices of the inputs ``gm`` mutates, its example outputs).

    torch 2.9 takes the placeholders' example values as an argument; newer
    torch (2.1x) reads them from the graph itself.
    """
    import inspect

    params = inspect.signature(check_input_alias_and_mutation_return_outputs).parameters
    if len(params) == 1:
        *_, mutated, outputs = check_input_alias_and_mutation_return_outputs(gm)
    else:
        vals = [n.meta.get("val", n.meta.get("example_value")) for n in gm.graph.find_nodes(op="placeholder")]
        *_, mutated, outputs = check_input_alias_and_mutation_return_outputs(gm, vals)
    return mutated, outputs


def install_as_upstream_scan(op):
    """Make ``torch.ops.higher_order.scan`` resolve to ``op``.

    The HOP registry and the ``torch.ops.higher_order`` namespace cache the
    first object under a name, so both must be overwritten (NOTES decision 1).
    """
    torch._ops._higher_order_ops["scan"] = op
    setattr(torch.ops.higher_order, "scan", op)


def under_make_fx():
    """True while a make_fx trace runs on THIS thread (so subgraphs must re-enter it).

    make_fx keeps its tracer in a process-wide global; another thread's trace
    must not count, so the tracer only counts with a proxy mode on this
    thread's stack or inside one of our own traces here (``tracing_lock``).
    """
    if _proxy_tensor._CURRENT_MAKE_FX_TRACER is None:
        return False
    return _local_depth() > 0 or _proxy_tensor.get_proxy_mode() is not None


_TRACE_LOCK = threading.RLock()
_LOCAL = threading.local()
_MAX_OUR_SOURCES = 512
_our_sources = collections.deque()


def _local_depth():
    return getattr(_LOCAL, "depth", 0)


@contextlib.contextmanager
def tracing_lock():
    """Serializes this package's traces across threads (make_fx's tracer is a
    process-wide global) and bounds the FX sources they leave in linecache.

    Every GraphModule compiles its code under a fresh ``<eval_with_key>.N``
    entry that torch never drops; a scan traced on every call would grow them
    without bound. Only the newest few hundred of ours are kept (they serve
    tracebacks only; the compiled code does not need them).
    """
    with _TRACE_LOCK:
        depth = _local_depth()
        _LOCAL.depth = depth + 1
        before = len(_fx_loader().eval_cache) if depth == 0 else None
        try:
            yield
        finally:
            _LOCAL.depth = depth
            if before is not None:
                _forget_old_sources(before)


def _fx_loader():
    from torch.fx import graph_module

    return graph_module._loader


def _forget_old_sources(before):
    import linecache

    cache = _fx_loader().eval_cache
    new = len(cache) - before
    _our_sources.extend(reversed(list(itertools.islice(reversed(cache), max(new, 0)))))
    while len(_our_sources) > _MAX_OUR_SOURCES:
        key = _our_sources.popleft()
        cache.pop(key, None)
        linecache.cache.pop(key, None)


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


def _functionalize_transform_active():
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Functionalize for i in retrieve_all_functorch_interpreters())


def _is_eager_tensor(t):
    return not isinstance(t, (FakeTensor, FunctionalTensor)) and not torch._is_functional_tensor(t) \
        and t.device.type not in ("xla", "lazy")


def runs_eagerly(tensors):
    """No tracer (make_fx, fake mode, Dynamo, functionalization) is active and
    every tensor holds real data off XLA: the scan is the Python loop.
    torch.func's vmap/grad/jvp wrappers count as eager: the loop composes with them."""
    if is_dynamo_compiling() or dispatch_modes_active() or _functionalize_transform_active():
        return False
    return all(_is_eager_tensor(t) for t in tensors if isinstance(t, torch.Tensor))


def global_module_hooks_registered():
    from torch.nn.modules import module as m

    return any(getattr(m, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))


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
    with _data_dependence_as_scan_error():
        if under_make_fx() or detect_fake_mode(args) is not None:
            return materialize_as_graph(fn, tuple(args), force_enable_grad=force_enable_grad)
        return _trace_fresh(fn, args, force_enable_grad)


@contextlib.contextmanager
def _data_dependence_as_scan_error():
    """A body that reads a tensor's value (``if c.sum() > 0``, ``.item()``,
    ``bool(flag)``) cannot become one graph: say so in the user's terms."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from ._trees import ScanError

    try:
        yield
    except (DataDependentOutputException, GuardOnDataDependentSymNode) as e:
        raise ScanError(
            "scan: the body reads the value of a tensor as a Python value (data-dependent control "
            "flow such as `if t.sum() > 0`, `.item()`, `bool(t)`), which a traced scan (make_fx, "
            "torch.compile, export, XLA) cannot capture as one graph. Use torch.where / masking "
            f"instead, or run eagerly. (torch: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def _trace_fresh(fn, args, force_enable_grad):
    with contextlib.ExitStack() as stack:
        stack.enter_context(tracing_lock())
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
    tensor, which keeps its autograd identity. A stand-in requires grad when
    its tensor does, so a joint trace can differentiate with respect to it.
    CPU tensors meeting XLA ones are stood in for by device copies.
    """

    def __init__(self):
        super().__init__()
        self._outer, self._by_id, self._moved, self.xla, self.inputs = {}, {}, {}, None, {}

    def _stand_in(self, t, user=None):
        if user is None and (not (isinstance(t, torch.Tensor) and torch._is_functional_tensor(t))
                             or isinstance(t, FakeTensor) or id(t) in self.inputs):
            return t
        user = t if user is None else user
        hit = self._by_id.get(id(user))
        if hit is None:
            torch._sync(t)
            plain = torch._from_functional_tensor(t)  # its value, without the wrapper
            self._outer[id(plain)] = user
            used = plain.detach().requires_grad_() if user.requires_grad else plain
            hit = self._by_id[id(user)] = (used, user, plain, t)  # plain and t kept alive: ids are keys
        return hit[0]

    def _onto(self, device):
        """CPU tensors meeting XLA ones move to the device, as torch_xla moves
        them per op in eager (fake tracing rejects the mix): a traced value in
        the graph, a closure as a device copy standing in for it."""
        def onto(t):
            if not _cpu_array(t) or id(t) in self.inputs:
                return t
            if isinstance(t, FakeTensor):
                return t.to(device)
            if id(t) not in self._by_id:
                with unset_fake_temporarily(), disable_proxy_modes_tracing():
                    moved = t.detach().to(device)
                self._stand_in(moved, user=t)
            return self._by_id[id(t)][0]
        return onto

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.autograd.grad:  # differentiates w.r.t. the tensors named, stand-ins or not
            return func(*args, **(kwargs or {}))
        tree_map = torch.utils._pytree.tree_map
        args, kwargs = tree_map(self._stand_in, (args, kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        xla = next((t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "xla"), None)
        self.xla = self.xla or xla
        if self.xla is not None and any(_cpu_array(t) for t in leaves):  # also ops on CPU tensors alone
            args, kwargs = tree_map(self._onto(self.xla), (args, kwargs))
        return func(*args, **kwargs)

    def outer(self, t):
        """The user's tensor that stand-in ``t`` replaced (else ``t``)."""
        return self._outer.get(id(t), t)

    def inner(self, t):
        """What the body read in place of the user's ``t``: its stand-in, ``t``
        itself if it needed none, None if a functional ``t`` was never read."""
        hit = self._by_id.get(id(t))
        if hit is not None:
            return hit[0]
        return None if torch._is_functional_tensor(t) and not isinstance(t, FakeTensor) else t

    def op_input(self, user):
        """What the op receives for the user's closure ``user``. A CPU closure
        that requires grad in a body on XLA becomes a differentiable copy on
        the device: its gradient comes back to it through the copy, and the
        body's backward stays on one device (autograd would run CPU nodes on
        another thread, both dispatching into one fake mode while partitioning)."""
        if self.xla is None or user.device.type != "cpu" or not user.requires_grad or isinstance(user, FakeTensor):
            return user
        if id(user) not in self._moved:
            with disable_proxy_modes_tracing(), torch.enable_grad():
                self._moved[id(user)] = user.to(self.xla)
        return self._moved[id(user)]


def _cpu_array(t):
    """A CPU tensor with dims: fake tracing lets only 0-dim ones mix with XLA tensors."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0


@contextlib.contextmanager
def recording_functional_closures(tensors=()):
    """Yields the stand-in mode: ``.outer(t)`` / ``.inner(t)`` map between the
    user's closures and what the traced body read, ``.op_input(t)`` says what
    the op receives for a closure. With XLA ``tensors`` (the step's inputs),
    every CPU tensor the body touches is on the device from the start."""
    mode = _ClosureStandIns()
    mode.xla = next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"), None)
    mode.inputs = {id(t): t for t in tensors}  # the step's own inputs are traced, not stood in for
    with mode:
        yield mode


def detached_examples(values):
    """Detached example values of one step, outside any graph. Under a fake
    mode a real tensor (a constant the body created, lifted) becomes fake, with
    static shapes: a fresh symbol would become a guard export cannot evaluate."""
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    with disable_proxy_modes_tracing():
        return [(mode.from_tensor(v, static_shapes=True) if mode is not None and not isinstance(v, FakeTensor) else v).detach()
                if isinstance(v, torch.Tensor) else v for v in values]


def fresh_fake_mode():
    return FakeTensorMode(allow_non_fake_inputs=True)


def detect_fake_mode(tensors):
    from torch._guards import detect_fake_mode as _detect

    return _detect(tensors)


def tag_forward_nodes(num_primals):
    """Tag what the joint trace has recorded so far as the forward, as
    AOTAutograd does: newer torch's default_partition takes the forward to be
    every node up to the last one tagged "is_forward" (untagged, "save_all"
    would recompute everything). torch 2.9 reads only the backward tags."""
    mode = _proxy_tensor.get_proxy_mode()
    if mode is None:
        return
    placeholders = 0
    for node in mode.tracer.graph.nodes:
        is_tangent = node.op == "placeholder" and placeholders >= num_primals
        placeholders += node.op == "placeholder"
        node.meta["partitioner_tag"] = "is_backward" if is_tangent else "is_forward"


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


class _ReplayList(list):
    """torch 2.9's SAC storage: a list per op that the backward ``pop(0)``s.
    Replaying instead of consuming lets a step checkpointed selectively be
    backwarded more than once, as the loop's own tape can (retain_graph,
    gradcheck); positions restart at each recompute."""

    pos = 0

    def pop(self, index=-1):
        item = self[self.pos]
        self.pos += 1
        return item


class _ReplayDict(dict):
    """Newer torch's SAC storage: ``{call index: saved}`` per op, an entry
    marked consumed once used. Keeping the entry allows a second backward."""

    def __setitem__(self, key, value):
        from torch.utils import checkpoint as ckpt

        if key in self and value is getattr(ckpt, "_CONSUMED", None):
            return
        super().__setitem__(key, value)


def replayable_selective_checkpoint_contexts(policy_fn):
    """torch's ``create_selective_checkpoint_contexts`` with replaying storage."""
    from torch.utils import checkpoint as ckpt

    caching, cached = ckpt.create_selective_checkpoint_contexts(policy_fn)
    storage = caching.storage
    if storage.default_factory is dict:  # newer torch: indexed entries
        storage.default_factory = _ReplayDict
        return caching, cached

    class Replaying(type(cached)):  # torch 2.9: lists, positions reset per recompute
        def __enter__(self):
            for saved in self.storage.values():
                saved.pos = 0
            return super().__enter__()

    storage.default_factory = _ReplayList
    return caching, Replaying(policy_fn, storage, False)


def scan_schema(op, combine_fn, init, xs, additional_inputs, examples, options):
    """torch's HopSchemaGenerator filled in for a scan call (torch 2.9's API)."""
    from torch._higher_order_ops.schema import HopSchemaGenerator

    from ._trees import ScanError

    gm = combine_fn if isinstance(combine_fn, torch.fx.GraphModule) else materialize_as_graph(combine_fn, tuple(examples))
    mutated, outputs = input_mutations_and_outputs(gm)
    if mutated:
        raise ScanError(f"scan: the body mutates its inputs {sorted(mutated)} in place; scan bodies must be functional.")
    gen = HopSchemaGenerator(op)
    gen.add_arg("combine_fn", gm)
    for prefix, values in (("init", init), ("xs", xs), ("additional_input", additional_inputs)):
        for i, value in enumerate(values):
            gen.add_arg(f"{prefix}{i}", value)
    for name, value in options.items():  # a remat partition function is named, not embedded
        gen.add_arg(name, value if not callable(value) else getattr(value, "__name__", repr(value)), kw_only=True)
    for out in outputs:
        gen.add_output(out)
    gen.add_schema_tree_spec(combine_fn, init, xs, additional_inputs, **options)
    return gen.gen_schema()


# ---------------------------------------------------------------- functorch (torch 2.9)
from torch._C._functorch import TransformType  # noqa: E402,F401


def functorch_level(t):
    """The vmap level of a batched tensor, else None."""
    f = torch._C._functorch
    return f.maybe_get_level(t) if f.is_batchedtensor(t) else None


def functorch_unwrap(t):
    return torch._C._functorch.get_unwrapped(t)


def functorch_bdim(t):
    return torch._C._functorch.maybe_get_bdim(t)


def is_batched_here(t):
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_batchedtensor(t)


def add_batch_dim(t, bdim, level):
    from torch._C._functorch import _add_batch_dim

    return _add_batch_dim(t, bdim, level)
