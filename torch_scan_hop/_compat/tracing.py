"""Tracing: make_fx and its proxy mode, fake tensors, functionalization, the
adapters the body trace (``trace.graph``), closure stand-ins (``trace.closures``)
and the tracing lock (``core.trace_lock``) use.

Names re-exported as they are (torch 2.9 to 2.15, same API on all; 2.14 adds
only optional arguments): ``make_fx``, ``ProxyTorchDispatchMode``,
``disable_proxy_modes_tracing``, ``track_tensor_tree``
(``torch.fx.experimental.proxy_tensor``); ``FakeTensor``, ``FakeTensorMode``,
``unset_fake_temporarily`` (``torch._subclasses.fake_tensor``);
``CppFunctionalizeAPI``, ``FunctionalTensor``, ``disable_functional_mode``
(``torch._subclasses.functional_tensor``); ``pytree`` (``torch.utils._pytree``,
whose tree_map / tree_leaves / tree_flatten / TreeSpec are the same on all).
"""
import contextlib
import functools

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



def make_fx_tracer():
    """The tracer of the make_fx trace under way in any thread (a process-wide global), else None.
    torch 2.9 to 2.15: ``proxy_tensor._CURRENT_MAKE_FX_TRACER`` on all."""
    return _proxy_tensor._CURRENT_MAKE_FX_TRACER


def fx_source_cache():
    """FX's cache of generated GraphModule sources, ``{"<eval_with_key>.N": source}`` in the order
    they were made (linecache reads it for tracebacks), which torch never empties. torch 2.9 to
    2.15: ``torch.fx.graph_module._loader.eval_cache`` on all."""
    from torch.fx import graph_module

    return graph_module._loader.eval_cache


def pre_dispatch_function_mode():
    """The class of the torch-function mode a pre-dispatch trace (export's) records grad-mode
    changes with (torch 2.9 to 2.15: ``proxy_tensor.PreDispatchTorchFunctionMode``)."""
    return _proxy_tensor.PreDispatchTorchFunctionMode


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
    torch 2.9 to 2.15: ``make_fx(tracing_mode="fake", _allow_non_fake_inputs=True)``.

    The tracer's own references to those constants are dropped once the graph is made (the
    graph keeps its own): the tracer sits in reference cycles (its proxies' closures), so it
    kept them alive until Python's gc ran. On XLA a live tensor is an output of the step's
    program: a body's closures (scan_model's stacked weights, made anew each step) were then
    outputs of the first step's program and of no later one, and XLA compiled the step twice."""
    traced = make_fx(_recording_tracer(fn, tracers := []), tracing_mode="fake", _allow_non_fake_inputs=True)

    @functools.wraps(fn)
    def run(*args):
        gm = None
        try:
            gm = traced(*args)
            return gm
        finally:
            for tracer in tracers:
                if getattr(tracer, "root", None) is not gm:  # (the graph's own module keeps them)
                    _drop_constants(tracer)
            tracers.clear()
    return run


def _recording_tracer(fn, tracers):
    @functools.wraps(fn)
    def recording(*args):
        mode = _proxy_tensor.get_proxy_mode()
        if mode is not None:
            tracers.append(mode.tracer)
        return fn(*args)
    return recording


def _drop_constants(tracer):
    """The tensors a make_fx tracer stowed as constants, off its root module and its
    ``tensor_attrs`` (torch 2.9 to 2.15: ``_tensor_constantN`` / ``_param_constantN``
    attributes of ``tracer.root``, ``fx.Tracer.tensor_attrs``)."""
    root = getattr(tracer, "root", None)
    for name, value in list(vars(root).items()) if root is not None else ():
        if isinstance(value, torch.Tensor) and name.startswith(("_tensor_constant", "_param_constant")):
            delattr(root, name)
    attrs = getattr(tracer, "tensor_attrs", None)
    if isinstance(attrs, dict):
        attrs.clear()


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


def fake_rule_checks():
    """The list FakeTensorMode consults before an op's meta kernel, ``[(applies(func),
    rule(fake_mode, func, *args, **kwargs))]`` (a rule returning NotImplemented passes the call
    on). torch 2.9 to 2.15: ``torch._subclasses.fake_impls.op_implementations_checks``."""
    from torch._subclasses import fake_impls

    return fake_impls.op_implementations_checks


def in_kernel_invocation(fake_mode):
    """A context in which a fake rule runs a meta kernel on the fakes' meta tensors.
    torch 2.9 to 2.15: ``torch._subclasses.fake_tensor.in_kernel_invocation_manager``."""
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    return in_kernel_invocation_manager(fake_mode)


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


def lazy_graph_modules():
    """A context in which the GraphModules FX makes (make_fx's, the partitioners') write their
    Python code only when first run or printed, not on every ``recompile()``: most graphs of a
    first call are only read node by node (partitioned, lowered to XLA, keyed) and never run.
    Dynamo builds all its graphs so (``torch._dynamo.config.use_lazy_graph_module``, on by
    default). torch 2.9 to 2.15: ``torch.fx._lazy_graph_module._use_lazy_graph_module``."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def lazy_graph_module(root, graph):
    """``torch.fx.GraphModule(root, graph)`` whose Python code is written when first run or
    printed (see ``lazy_graph_modules``). torch 2.9 to 2.15: ``torch.fx._lazy_graph_module._LazyGraphModule``."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)
