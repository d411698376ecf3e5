"""Tracing: make_fx and its proxy mode, fake tensors, functionalization, the
adapters the body trace (``trace.graph``) and closure stand-ins (``trace.closures``)
use, and the tracing lock.

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


@contextlib.contextmanager
def outer_grad_mode_recorders_suspended():
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


def make_fx_fake_mode():
    """The fake mode the running make_fx (``tracing_mode`` fake or symbolic) made for itself,
    else None. torch 2.9 to 2.15: ``_CURRENT_MAKE_FX_TRACER.fake_tensor_mode`` on all."""
    return getattr(_proxy_tensor._CURRENT_MAKE_FX_TRACER, "fake_tensor_mode", None)


@contextlib.contextmanager
def functionalization_suspended():
    """Functional wrappers (torch.func.functionalize, XLA) off for a fresh make_fx trace.
    torch 2.9 to 2.15: ``torch._dispatch.python.suspend_functionalization`` and
    ``disable_functional_mode``."""
    with suspend_functionalization(), disable_functional_mode():
        yield


def fake_trace(fn):
    """``fn`` traced by make_fx in a fresh fake mode that accepts real inputs (constants).
    torch 2.9 to 2.15: ``make_fx(tracing_mode="fake", _allow_non_fake_inputs=True)``."""
    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)


def functional_value(t):
    """The value inside functional wrapper ``t``, its pending updates applied.
    torch 2.9 to 2.15: ``torch._sync`` then ``torch._from_functional_tensor``."""
    torch._sync(t)
    return torch._from_functional_tensor(t)


def plain_functional_wrapper(t):
    """``t`` (a tensor below functionalization) wrapped as the C++ functionalization wraps
    an ordinary op's output: no functorch level. ``CppFunctionalizeAPI.wrap_tensors`` wraps at
    level 0, which Dynamo's fake conversion of an XLA tensor cannot read ("assert t.unwrapped
    is not None"). torch 2.9 to 2.15: ``torch._to_functional_tensor``."""
    return torch._to_functional_tensor(t) if isinstance(t, torch.Tensor) else t


def active_vmap_levels():
    """The levels of the vmaps on the functorch interpreter stack (torch 2.9 to 2.15:
    ``retrieve_all_functorch_interpreters``, each with ``key()`` and ``level()``)."""
    from .functorch import TransformType, _interpreters

    return {i.level() for i in _interpreters() if i.key() == TransformType.Vmap}


def proxy_mode():
    """The proxy mode of the make_fx trace under way, else None (``proxy_tensor.get_proxy_mode``)."""
    return _proxy_tensor.get_proxy_mode()


def has_proxy_slot(t, tracer):
    """``tracer`` has traced ``t`` (``proxy_tensor.has_proxy_slot``, torch 2.9 to 2.15)."""
    return _proxy_tensor.has_proxy_slot(t, tracer)


def get_proxy_slot(obj, tracer, default):
    """``obj``'s proxy in ``tracer``, else ``default`` (``proxy_tensor.get_proxy_slot``, torch 2.9 to 2.15)."""
    return _proxy_tensor.get_proxy_slot(obj, tracer, default)


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


def statically_known_true(expr):
    """``expr`` (a bool or SymBool) is known true without adding a guard.
    torch 2.9 to 2.15: ``torch.fx.experimental.symbolic_shapes.statically_known_true``."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    return known(expr)


def printing_fx_code():
    """Whether FX is writing a graph's Python code further up this thread's stack
    (``torch.fx.graph.CodeGen._gen_python_code``, torch 2.9 to 2.15), e.g. the partial graph
    that ``Tracer.trace`` prints into a data-dependent error, reading every node's sizes."""
    import sys

    code, frame = torch.fx.graph.CodeGen._gen_python_code.__code__, sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None
