"""Tracing: make_fx and its proxy mode, fake tensors, functionalization, the
body trace (``trace_aten_graph``), closure stand-ins and the tracing lock.

Names re-exported as they are (torch 2.9 to 2.15, same API on all; 2.14 adds
only optional arguments): ``make_fx``, ``ProxyTorchDispatchMode``,
``disable_proxy_modes_tracing``, ``track_tensor_tree``
(``torch.fx.experimental.proxy_tensor``); ``FakeTensor``, ``FakeTensorMode``,
``unset_fake_temporarily`` (``torch._subclasses.fake_tensor``);
``CppFunctionalizeAPI``, ``FunctionalTensor``, ``disable_functional_mode``
(``torch._subclasses.functional_tensor``); ``pytree`` (``torch.utils._pytree``,
whose tree_map / tree_leaves / tree_flatten / TreeSpec are the same on all).
"""
import collections
import contextlib
import itertools
import threading

import torch
import torch.utils._pytree as pytree  # noqa: F401  (re-exported for core.trees and op.proxy)
from torch._dispatch.python import suspend_functionalization
from torch._subclasses.fake_tensor import (  # noqa: F401
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
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

from .hop import _from_fun, materialize_as_graph


def under_make_fx():
    """True while a make_fx trace runs on THIS thread (so subgraphs must re-enter it).

    make_fx keeps its tracer in a process-wide global; another thread's trace
    must not count, so the tracer only counts with a proxy mode on this
    thread's stack or inside one of our own traces here (``tracing_lock``).
    torch 2.9 to 2.15: the global is ``proxy_tensor._CURRENT_MAKE_FX_TRACER`` on all.
    """
    if _proxy_tensor._CURRENT_MAKE_FX_TRACER is None:
        return False
    return _local_depth() > 0 or _proxy_tensor.get_proxy_mode() is not None


_TRACE_LOCK = threading.RLock()
_LOCAL = threading.local()
_MAX_OUR_SOURCES = 512
_our_sources = collections.deque()


def inside_our_trace():
    """True inside one of this package's own traces on this thread (a scan body's)."""
    return _local_depth() > 0


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
    torch 2.9 to 2.15: ``torch.fx.graph_module._loader.eval_cache`` on all.
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


def trace_aten_graph(fn, args, *, force_enable_grad=False):
    """Trace ``fn(*args)`` to an aten GraphModule in whatever mode is active.

    Re-enters an outer make_fx trace (or fake mode) if there is one; on real
    tensors traces with a fresh fake mode, so nothing real is computed and
    closed-over real tensors become constants (which ``trace.lift`` turns into inputs).
    torch 2.9 to 2.15: ``materialize_as_graph`` and ``make_fx(tracing_mode="fake",
    _allow_non_fake_inputs=True)`` behave the same on all.
    """
    from .hop import without_effectful_checks

    fn = without_effectful_checks(fn)
    if under_make_fx():
        if _of_another_fake_mode(args):
            return _trace_fresh(fn, args, force_enable_grad)
        with _outer_grad_mode_recorders_suspended():
            return materialize_as_graph(fn, tuple(args), force_enable_grad=force_enable_grad)
    if detect_fake_mode(args) is not None:
        return materialize_as_graph(fn, tuple(args), force_enable_grad=force_enable_grad)
    return _trace_fresh(fn, args, force_enable_grad)


@contextlib.contextmanager
def _outer_grad_mode_recorders_suspended():
    """The outer pre-dispatch trace's torch-function mode (export's) off the stack while a body
    is traced into a subgraph.

    That mode records ``torch._C._set_grad_enabled`` calls (a body's ``torch.no_grad()``) as
    graph nodes. The re-entered body trace has its own, which records them into the body, then
    runs the call, which reaches the outer mode below it: the outer graph got a stray grad-mode
    region of its own, which ``torch.export.load`` rejects ("Node.meta
    wrap_with_set_grad_enabled is missing val field"). Other torch-function modes stay.
    torch 2.9 to 2.15: ``proxy_tensor.PreDispatchTorchFunctionMode`` and ``torch._C``'s
    ``_len_torch_function_stack`` / ``_pop_torch_function_stack`` / ``_push_on_torch_function_stack``.
    """
    recorder = _proxy_tensor.PreDispatchTorchFunctionMode
    popped = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    kept = [m for m in reversed(popped) if not isinstance(m, recorder)]  # bottom first
    for mode in kept:
        torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        for _ in kept:
            torch._C._pop_torch_function_stack()
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def _of_another_fake_mode(args):
    """True when ``args`` are fake tensors of another fake mode than the one the running
    make_fx (``tracing_mode`` fake or symbolic) made for itself.

    Upstream's front end ``torch._higher_order_ops.scan.scan`` compiles itself with
    Dynamo even inside a make_fx trace; Dynamo's fake run of our node then hands us
    Dynamo's own fake tensors. Re-entering the outer tracer on them mixes two fake
    modes ("Mixing fake modes NYI"); a trace of their own (make_fx adopts their mode)
    is what the outer trace later sees run. A make_fx on real tensors has no mode of
    its own (None): export runs it under its ambient fake mode, whose tensors must be
    traced into the export graph, so that case re-enters as before.
    torch 2.9 to 2.15: ``_CURRENT_MAKE_FX_TRACER.fake_tensor_mode`` on all.
    """
    outer = getattr(_proxy_tensor._CURRENT_MAKE_FX_TRACER, "fake_tensor_mode", None)
    return outer is not None and any(isinstance(a, FakeTensor) and a.fake_mode is not outer for a in args)


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
    CPU tensors meeting XLA ones are stood in for by device copies, and closures
    batched by a vmap that was active before the trace by plain constants of
    their logical shape (``_batched_stand_in``).

    torch 2.9 to 2.15: ``torch._is_functional_tensor``, ``torch._sync``,
    ``torch._from_functional_tensor`` and functorch's ``is_batchedtensor`` /
    ``maybe_get_level`` are unchanged.
    """

    def __init__(self):
        super().__init__()
        self._outer, self._by_id, self._moved, self.xla, self.inputs = {}, {}, {}, None, {}
        self._aliases = {}
        self.vmap_levels = _active_vmap_levels()

    def _stand_in(self, t, user=None):
        if user is None and self.vmap_levels and self._batched_outside(t) and id(t) not in self.inputs:
            return self._batched_stand_in(t)
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

    def _batched_outside(self, t):
        """A closure batched by a vmap that was active before the trace began (the body
        is traced on unbatched stand-ins of its carries and x while that vmap is still
        on the interpreter stack). A vmap inside the body has a higher level."""
        return (isinstance(t, torch.Tensor) and torch._C._functorch.is_batchedtensor(t)
                and torch._C._functorch.maybe_get_level(t) in self.vmap_levels
                and all(type(d) is int for d in t.shape))

    def _batched_stand_in(self, t):
        """make_fx traces the batched closure's physical value under the vmap, so the
        body's outputs came out batched, untracked: the body's graph returned them as
        constants (wrong values, silently). The body reads a plain constant of the
        closure's logical shape instead; lifting hands back the batched tensor, and
        the op's vmap rule batches the body over it, as over a batched carry."""
        hit = self._by_id.get(id(t))
        if hit is None:
            with unset_fake_temporarily(), disable_proxy_modes_tracing():
                plain = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
            self._outer[id(plain)] = t
            used = plain.requires_grad_() if t.requires_grad and plain.is_floating_point() else plain
            hit = self._by_id[id(t)] = (used, t, plain, t)
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
        if func in _METADATA_READS and args:
            args = (self._traced_view(args[0]), *args[1:])
            args, kwargs = tree_map(self._stand_in, (args, kwargs or {}))
        elif getattr(func, "__name__", None) == "__get__":  # an attribute read (t.layout in FX's codegen)
            args, kwargs = tree_map(self._stand_in, (args, kwargs or {}))
        else:  # an op on an outer trace's value (``v[0]`` in a nested scan's body) reads its sizes too
            args, kwargs = tree_map(self._traced_or_stood_in, (args, kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        xla = next((t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "xla"), None)
        self.xla = self.xla or xla
        if self.xla is not None and any(_cpu_array(t) for t in leaves):  # also ops on CPU tensors alone
            args, kwargs = tree_map(self._onto(self.xla), (args, kwargs))
        return func(*args, **kwargs)

    def _traced_or_stood_in(self, t):
        """A fake value (never stood in for) as the current trace can read it; anything else stood in for."""
        return self._traced_view(t) if isinstance(t, FakeTensor) else self._stand_in(t)

    def _traced_view(self, t):
        """What a size read of ``t`` reads: ``t``, or an alias the current trace knows.

        A closure from an outer symbolic trace has sizes like ``s3`` that the
        body's own (re-entered) tracer has never seen: a body reading only
        ``W.shape[-1]`` would fail deep in torch ("s3 is not tracked with
        proxy"). One traced ``alias`` of it is a graph constant (lifted like
        any closure) whose sizes, strides and numel the trace can compute.
        torch 2.9 to 2.15: ``get_proxy_mode``, ``has_proxy_slot``, ``get_proxy_slot(obj, tracer, default)``.
        """
        mode = _proxy_tensor.get_proxy_mode() if isinstance(t, FakeTensor) else None
        if mode is None or _proxy_tensor.has_proxy_slot(t, mode.tracer):  # traced here: its sizes are too
            return t
        key = (id(mode.tracer), id(t))
        if key not in self._aliases:
            sizes = (*t.shape, *t.stride(), t.storage_offset(), t.numel())
            if all(_proxy_tensor.get_proxy_slot(s, mode.tracer, None) is not None
                   for s in sizes if isinstance(s, torch.SymInt)):
                return t
            self._aliases[key] = (torch.ops.aten.alias.default(t), t, mode.tracer)  # t, tracer kept alive: ids are keys
        return self._aliases[key][0]

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


_METADATA_READS = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.stride, torch.Tensor.storage_offset,
    torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.__len__,
})


def _active_vmap_levels():
    """The levels of the vmaps on the functorch interpreter stack (torch 2.9 to 2.15:
    ``retrieve_all_functorch_interpreters``, each with ``key()`` and ``level()``)."""
    from .functorch import TransformType, _interpreters

    return {i.level() for i in _interpreters() if i.key() == TransformType.Vmap}


def _cpu_array(t):
    """A CPU tensor with dims: fake tracing lets only 0-dim ones mix with XLA tensors."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0


@contextlib.contextmanager
def recording_functional_closures(tensors=()):
    """Yields the stand-in mode: ``.outer(t)`` / ``.inner(t)`` map between the
    user's closures and what the traced body read, ``.op_input(t)`` says what
    the op receives for a closure. With XLA ``tensors`` (the step's inputs),
    every CPU tensor the body touches is on the device from the start.
    torch 2.9 to 2.15 (see ``_ClosureStandIns``)."""
    mode = _ClosureStandIns()
    mode.xla = next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"), None)
    mode.inputs = {id(t): t for t in tensors}  # the step's own inputs are traced, not stood in for
    with mode:
        yield mode


def detached_examples(values):
    """Detached example values of one step, outside any graph. Under a fake
    mode a real tensor (a constant the body created, lifted) becomes fake, with
    static shapes: a fresh symbol would become a guard export cannot evaluate.
    torch 2.9 to 2.15: ``FakeTensorMode.from_tensor(static_shapes=True)`` on all."""
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    with disable_proxy_modes_tracing():
        return [(mode.from_tensor(v, static_shapes=True) if mode is not None and not isinstance(v, FakeTensor) else v).detach()
                if isinstance(v, torch.Tensor) else v for v in values]


def fresh_fake_mode():
    """A fake mode that accepts real inputs (constants). torch 2.9 to 2.15: the
    same ``FakeTensorMode(allow_non_fake_inputs=True)`` on all."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def tracing_context_fake_mode():
    """The fake mode of the Dynamo / AOTAutograd trace under way, else None.
    torch 2.9 to 2.15: ``torch._guards.TracingContext.try_get()`` and its ``fake_mode``."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    return None if context is None else context.fake_mode


def detect_fake_mode(tensors):
    """The fake mode active or carried by ``tensors``, else None.
    torch 2.9 to 2.15: ``torch._guards.detect_fake_mode``."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(tensors)


def allow_scalar_outputs(shape_env):
    """Let this ShapeEnv produce unbacked scalars (what capture_scalar_outputs sets per frame).
    torch 2.9 to 2.15: ``ShapeEnv.settings`` is a frozen dataclass on all."""
    import dataclasses

    if shape_env is not None and not shape_env.settings.allow_scalar_outputs:
        shape_env.settings = dataclasses.replace(shape_env.settings, allow_scalar_outputs=True)


def known_int(n):
    """Is the int ``n`` known at trace time: a Python int, not a size left symbolic
    (``torch.compile(dynamic=True)``, make_fx's symbolic mode)?

    Under Dynamo a symbolic int passes ``isinstance(n, int)`` and ``type(n) is int``,
    and comparing it installs a guard (one graph per value); ``statically_known_true``
    is evaluated by Dynamo on the symbol without a guard. Any known int is below 2**62;
    a backed size symbol's range is unbounded above, so the bound is not known for it.
    torch 2.9 to 2.15: ``torch.fx.experimental.symbolic_shapes.statically_known_true``."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return isinstance(n, (int, torch.SymInt)) and statically_known_true(n < 2 ** 62)


def known_contiguous(t):
    """``t``'s strides are known, without a guard, to be the contiguous ones of its sizes
    (a tensor with symbolic sizes: each stride compared as a symbolic expression)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not statically_known_true(size <= 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True
