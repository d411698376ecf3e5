"""Dynamo internals our scan tracker uses (torch 2.9 to 2.15), in one place.

Dynamo has no public API for a HigherOrderOperator's VariableTracker: the
tracker subclasses ``TorchHigherOrderOperatorVariable`` and calls the helpers
upstream's own HOP trackers use. Each adapter below says which torch versions
it serves and how they differ; ``op.dynamo`` imports nothing else from Dynamo.
"""
import functools

import torch


def _hops():
    from torch._dynamo.variables import higher_order_ops

    return higher_order_ops


def uncaptured_error_class():
    """Dynamo's hard error for a HOP it cannot capture (2.9 to 2.15: same class)."""
    from torch._dynamo.exc import UncapturedHigherOrderOpError

    return UncapturedHigherOrderOpError


def unsupported_error_classes():
    """A graph break. torch 2.14 lets it leave the tracker's ``_call_function``
    (its class wrapper then makes it a hard error); 2.9's ``hard_error`` has
    already turned it into an UncapturedHigherOrderOpError there."""
    from torch._dynamo.exc import ObservedException, Unsupported

    return (Unsupported, ObservedException)


def raised_error_classes():
    """What Dynamo wraps an error the body's own code raised in: ``ObservedException`` (a simulated
    ``raise``, torch 2.9 to 2.15; an op's failed fake run on 2.15) and ``TorchRuntimeError`` (an
    op's failed fake run, 2.9)."""
    from torch._dynamo.exc import ObservedException, TorchRuntimeError

    return (ObservedException, TorchRuntimeError)


def is_dynamo_exception(e):
    """One of Dynamo's own exception classes (its wrappers around an error), not the error itself."""
    return type(e).__module__.startswith("torch._dynamo")


def tracker_base():
    """The base class of HOP trackers, with graph breaks in the body made hard
    errors. 2.14 reads the class attributes ``_HOP_NAME`` and
    ``_ALLOW_FALLBACK_TO_EAGER`` (False: an UncapturedHigherOrderOpError, not a
    silent fall back to eager); 2.9 ignores them and needs ``hard_error`` below."""
    base = _hops().TorchHigherOrderOperatorVariable

    class ScanTrackerBase(base):
        _HOP_NAME = "scan"
        _ALLOW_FALLBACK_TO_EAGER = False

    return ScanTrackerBase


def hop_tracker_base(name):
    """The base class of trackers for a HOP that is no scan. 2.14 requires the
    class attribute ``_HOP_NAME`` (error messages); a graph break inside stays
    one (``_ALLOW_FALLBACK_TO_EAGER``); 2.9 ignores both."""
    class HopTrackerBase(_hops().TorchHigherOrderOperatorVariable):
        _HOP_NAME = name
        _ALLOW_FALLBACK_TO_EAGER = True

    return HopTrackerBase


def hard_error(reason):
    """Decorator: a graph break inside makes the whole call a hard error.
    torch 2.9: ``raise_hard_error_if_graph_break``; 2.14 dropped it (the class
    attribute in ``tracker_base`` does this), so it is the identity there."""
    decorator = getattr(_hops(), "raise_hard_error_if_graph_break", None)
    return decorator(reason) if decorator is not None else (lambda fn: fn)


def graph_break(explanation):
    """Stop capturing with ``explanation``. torch 2.9 has ``unimplemented_v2``
    (positional); 2.14's ``unimplemented`` takes the same fields keyword-only."""
    from torch._dynamo import exc

    fields = dict(gb_type="torch_scan_hop.scan", context="", explanation=explanation, hints=[])
    if hasattr(exc, "unimplemented_v2"):
        exc.unimplemented_v2(**fields)
    exc.unimplemented(**fields)


def realize_all(value):
    """Lazy trackers made concrete (2.9 to 2.15)."""
    from torch._dynamo.variables.lazy import LazyVariableTracker

    return LazyVariableTracker.realize_all(value)


def discard_graph_changes(tx):
    """Run tracker code whose graph nodes are thrown away (2.9 to 2.15)."""
    return _hops().discard_graph_changes(tx)


def inlined(tx, fn):
    """``fn`` as a tracker Dynamo inlines. 2.9 keeps ``_make_inlined`` in
    higher_order_ops, 2.14 in torch._dynamo.utils."""
    make = getattr(_hops(), "_make_inlined", None)
    if make is None:
        from torch._dynamo.utils import _make_inlined as make
    return make(tx, fn)


def speculate_subgraph(tx, fn, args, **kwargs):
    """Trace ``fn`` into a subgraph: ``((output, spec), graph, lifted freevars)``.
    Same signature and result on 2.9 to 2.15 for the keywords we pass. Python
    floats the body reads stay constants: under dynamic=True torch 2.14 lifts
    an unspecialized float (``LayerNorm.eps``) as a 0-d tensor whose ``.item()``
    inside the body is data-dependent, which no scan body can be."""
    with torch._dynamo.config.patch(specialize_float=True):
        return _hops().speculate_subgraph(tx, fn, args, sub_kwargs={}, **kwargs)


def make_attr(tx, name):
    return _hops().make_attr(tx, name)


def call_and_unflatten(tx, op, args, kwargs, spec):
    """Record the op call and unflatten its output by ``spec``. torch 2.14
    added a required ``body_r`` (re-proxy the body's outputs: we pass None,
    our body outputs are not used outside it)."""
    fn = _hops()._call_function_and_unflatten_output
    if "body_r" in _parameters(fn):
        return fn(tx, op, args, kwargs, None, spec, None)
    return fn(tx, op, args, kwargs, None, spec)


@functools.lru_cache(maxsize=None)
def _parameters(fn):
    import inspect

    return tuple(inspect.signature(fn).parameters)


def fake_value(node, tx):
    """The fake value Dynamo recorded for a proxy node (2.9 to 2.15)."""
    from torch._dynamo.utils import get_fake_value

    return get_fake_value(node, tx)


def is_symbolic_int(var):
    from torch._dynamo.variables import SymNodeVariable

    return isinstance(var, SymNodeVariable)


def is_constant(var):
    from torch._dynamo.variables import ConstantVariable

    return isinstance(var, ConstantVariable)


def tracker_registry():
    """HOP name -> tracker class, where Dynamo looks trackers up (2.9 to 2.15)."""
    return _hops()._hop_name_to_variable_class


def is_exporting(tx):
    return bool(getattr(tx.output, "export", False))


def subgraph_module(tx, graph):
    """A GraphModule for a speculated body, owning the frame's modules (2.9 to 2.15)."""
    return torch.fx.GraphModule(dict(tx.output.nn_modules), graph)


def installed_subgraph(tx, name):
    """The subgraph Dynamo installed for the frame under ``name`` (a cond's branch) (2.9 to 2.15)."""
    return tx.output.nn_modules[name]


class recompile_limit_at_least:  # noqa: N801  (a context manager, used as a function)
    """Dynamo compiles one code object at most ``recompile_limit`` times, then
    runs it uncompiled; raise the limit for a block.
    torch 2.9 to 2.15: ``torch._dynamo.config.recompile_limit`` (default 8). Set and
    restored by hand: ``config.patch`` cost ~30 us per block, and an eager scan on
    XLA enters one per call."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        config = torch._dynamo.config
        self.old = config.recompile_limit
        if self.old < self.n:
            config.recompile_limit = self.n

    def __exit__(self, *exc):
        if self.old < self.n:
            torch._dynamo.config.recompile_limit = self.old


def hook_guards_skipped():
    """Dynamo guards no module hooks (its default, 2.9 to 2.15): a hook added
    after compiling is not seen."""
    return bool(getattr(torch._dynamo.config, "skip_nnmodule_hook_guards", False))


@functools.lru_cache(maxsize=None)
def guards_context_vars():
    """Dynamo traces ``ContextVar.get`` with a guard on its value (torch >= 2.15:
    ``ContextVarGetSource``); before, the call is a graph break."""
    import torch._dynamo.source as source
    return hasattr(source, "ContextVarGetSource")


# --- guards installed by hand (stacked storage's parameter check) -------------------------

def module_and_source(var):
    """``(module, source)`` for a tracker of an nn.Module Dynamo reached through a
    source (an argument, an attribute), else None (2.9 to 2.15: Unspecialized/NNModuleVariable
    keep the module in ``value``)."""
    value, source = getattr(var, "value", None), getattr(var, "source", None)
    if isinstance(value, torch.nn.Module) and source is not None:
        return value, source
    return None


def modified_in_trace(tx, objects):
    """Whether the frame being traced has changed any of ``objects`` so far (a dict
    item set, an attribute stored): Dynamo then holds state the real objects do not
    show yet. 2.9 to 2.15: ``side_effects`` keeps a tracker per object it tracks."""
    side_effects = tx.output.side_effects
    if getattr(side_effects, "ignore_mutation_on_these_variables", None):
        return True  # inside a traced functional_call: the dicts it swaps into are not marked
    for obj in objects:
        if obj in side_effects:
            try:
                if side_effects.is_modified(side_effects[obj]):
                    return True
            except AssertionError:  # 2.14: a tracker without a mutation type: assume changed
                return True
    return False


def attr_source(base, name):
    from torch._dynamo.source import AttrSource

    return AttrSource(base, name)


def dict_item_source(base, key):
    from torch._dynamo.source import DictGetItemSource

    return DictGetItemSource(base, key)


def guard_identity(sources):
    """One ID_MATCH guard per source: the compiled code runs again only while each
    source still gives the same object (2.9 to 2.15)."""
    from torch._dynamo.guards import GuardBuilder, install_guard

    install_guard(*(s.make_guard(GuardBuilder.ID_MATCH) for s in sources))


def constant(value):
    from torch._dynamo.variables import ConstantVariable

    return ConstantVariable.create(value)


def partial_tracker(fn, args):
    """A tracker for ``functools.partial(fn, *args)``, ``fn`` a Python function Dynamo inlines and
    ``args`` trackers (2.9 to 2.15: ``FunctoolsPartialVariable(func, args, keywords)``)."""
    from torch._dynamo.variables import UserFunctionVariable
    from torch._dynamo.variables.functions import FunctoolsPartialVariable

    return FunctoolsPartialVariable(UserFunctionVariable(fn), list(args), {})


def python_value(var, tx, modules=None):
    """The Python value a tracker stands for, for a function run at trace time on what the traced
    code holds: a tensor as its example value (a fake of Dynamo's fake mode), lists, tuples and
    dicts item by item, an nn.Module or a function as itself, constants as themselves (2.9 to
    2.15: ``TensorVariable``'s proxy node keeps ``example_value``, containers keep ``items``,
    dict keys are ``HashableTracker``s with ``vt``, module trackers keep ``value``). Modules met
    are appended to ``modules`` (to ask ``modified_in_trace`` of them).

    Raises:
        NotImplementedError: a value with no such stand-in (a symbolic int, an object built while
            tracing)."""
    from torch._dynamo.variables import BaseListVariable, ConstDictVariable, TensorVariable
    from torch._subclasses.fake_tensor import FakeTensor

    var = var.realize() if hasattr(var, "realize") else var
    if isinstance(var, TensorVariable):
        value = var.as_proxy().node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            raise NotImplementedError(f"no example value for {var}")
        if not isinstance(value, FakeTensor):  # a module's parameter reached by get_attr: its real self
            value = tx.fake_mode.from_tensor(value, static_shapes=True)
        return value
    if isinstance(var, BaseListVariable):
        items = [python_value(v, tx, modules) for v in var.items]
        return tuple(items) if issubclass(var.python_type(), tuple) else items
    if isinstance(var, ConstDictVariable):
        return {k.vt.as_python_constant(): python_value(v, tx, modules) for k, v in var.items.items()}
    if isinstance(getattr(var, "value", None), torch.nn.Module):
        if getattr(var, "source", None) is None:  # built while tracing: its real object lags the trace
            raise NotImplementedError(f"a module built while tracing: {var}")
        if modules is not None:
            modules.append(var.value)
        return var.value
    if hasattr(var, "get_function"):
        try:
            return var.get_function()
        except Exception as e:  # noqa: BLE001 -- a function built while tracing
            raise NotImplementedError(f"no function for {var}") from e
    return var.as_python_constant()


# --- what a speculation reads of its tensors' autograd state (op/carry_grads) ---------------

_FLAG_ATTRS = ("requires_grad", "has_grad_fn")  # has_grad_fn: what ``t.grad_fn`` is told from
_flag_recorders = []


def _recorded_flag(name):
    def get(var):
        try:
            value = var.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None
        node = getattr(var.__dict__.get("proxy"), "node", None)
        for nodes in _flag_recorders:
            nodes.append(node)
        return value

    def put(var, value):
        var.__dict__[name] = value

    return property(get, put)


class flag_reads:  # noqa: N801  (a context manager, used as a function)
    """Records the graph node of every TensorVariable whose ``requires_grad`` or
    ``has_grad_fn`` Dynamo reads in the block: the user's ``t.requires_grad`` and
    ``t.grad_fn``, an autograd.Function's ``ctx.needs_input_grad``, Dynamo's own checks.
    torch 2.9 to 2.15: TensorVariable keeps both as plain instance attributes, set in
    ``__init__`` and read wherever a tracker needs them, so a property on the class
    sees every read; it stores the value where the attribute was and is removed
    when the outermost block ends. Dynamo traces one frame at a time (its compile
    lock), so the property is not seen by another thread's trace."""

    def __enter__(self):
        from torch._dynamo.variables import TensorVariable

        if not _flag_recorders:
            for name in _FLAG_ATTRS:
                setattr(TensorVariable, name, _recorded_flag(name))
        self.nodes = []
        _flag_recorders.append(self.nodes)
        return self.nodes

    def __exit__(self, *exc):
        from torch._dynamo.variables import TensorVariable

        _flag_recorders.pop()
        if not _flag_recorders:
            for name in _FLAG_ATTRS:
                delattr(TensorVariable, name)


def tracer_graphs(tx):
    """The graphs of the tracer now active and of those it is nested in (2.9 to 2.15:
    ``SubgraphTracer.parent``)."""
    tracer, graphs = tx.output.current_tracer, []
    while tracer is not None:
        graphs.append(tracer.graph)
        tracer = tracer.parent
    return graphs


def frame_locals(tx):
    """The real Python values of the compiled frame's locals (2.9 to 2.15: the root
    translator's ``f_locals``); empty where not kept."""
    return dict(getattr(getattr(tx.output, "root_tx", None), "f_locals", None) or {})


def fake_mode(tx):
    """The frame's fake mode, for a run whose results are thrown away: the unbacked symbols
    it makes (an index read as a size) are not the frame's to bind (2.15 raises
    PendingUnbackedSymbolNotFound at the next node otherwise; 2.9 and 2.15:
    ``ShapeEnv.ignore_fresh_unbacked_symbols``)."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(tx.output.fake_mode)
    shape_env = tx.output.shape_env
    if shape_env is not None:
        stack.enter_context(shape_env.ignore_fresh_unbacked_symbols())
    return stack
