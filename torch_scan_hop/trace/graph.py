"""``trace_graph``: one function traced to an aten graph, with the errors a user can act on.

Every trace of a body (its forward, its joint, the checks) goes through here:
``trace_aten_graph`` chooses how to trace (re-enter an outer make_fx or fake mode, or a
fresh fake trace); ``trace_graph`` adds the torch_xla ops' autograd formulas a joint needs
(``xla_formulas``) and reports a body that reads a tensor's value as a ``ScanError`` in the
user's terms.
"""
import contextlib

import torch

from .. import _compat
from .._compat import tracing as _tracing
from ..core.aten_nodes import VALUE_IDENTITIES
from ..core.trace_lock import tracing_lock, under_make_fx
from ..core.trees import ScanError
from .effects import without_effectful_checks
from .indexing import TensorIndexRewrite
from .xla_formulas import register_missing


def trace_graph(fn, args, *, force_enable_grad=False):
    """``fn(*args)`` as an aten GraphModule, traced in whatever mode is active."""
    if force_enable_grad:  # differentiating: torch_xla's custom ops need their formulas
        register_missing()
    # lazy: the graph's Python code is written only if it is run or printed (most are only read)
    with _tracing.lazy_graph_modules(), _data_dependence_as_scan_error(), _in_place_sharding_as_scan_error(), \
            _real_index_as_scan_error(args), TensorIndexRewrite():
        gm = trace_aten_graph(fn, args, force_enable_grad=force_enable_grad)
    _refuse_value_dependent_sizes(gm)
    _drop_unread_aliases(gm)
    return gm


def trace_aten_graph(fn, args, *, force_enable_grad=False):
    """Trace ``fn(*args)`` to an aten GraphModule in whatever mode is active.

    Re-enters an outer make_fx trace (or fake mode) if there is one; on real
    tensors traces with a fresh fake mode, so nothing real is computed and
    closed-over real tensors become constants (which ``trace.lift`` turns into inputs).
    """
    fn = without_effectful_checks(fn)
    if under_make_fx():
        if _of_another_fake_mode(args):
            return _trace_fresh(fn, args, force_enable_grad)
        with outer_grad_mode_recorders_suspended():
            return _compat.materialize_as_graph(fn, tuple(args), force_enable_grad=force_enable_grad)
    fake_mode = _compat.detect_fake_mode(args)
    if fake_mode is not None:  # (entered: the inputs' copies are made under it, not as real tensors)
        with fake_mode:
            return _compat.materialize_as_graph(fn, tuple(args), force_enable_grad=force_enable_grad)
    return _trace_fresh(fn, args, force_enable_grad)


@contextlib.contextmanager
def outer_grad_mode_recorders_suspended():
    """The outer pre-dispatch trace's torch-function mode (export's) off the stack while a body
    is traced into a subgraph.

    That mode records ``torch._C._set_grad_enabled`` calls (a body's ``torch.no_grad()``) as
    graph nodes. The re-entered body trace has its own, which records them into the body, then
    runs the call, which reaches the outer mode below it: the outer graph got a stray grad-mode
    region of its own, which ``torch.export.load`` rejects ("Node.meta
    wrap_with_set_grad_enabled is missing val field"). Other torch-function modes stay.
    torch 2.9 to 2.15: ``proxy_tensor.PreDispatchTorchFunctionMode`` and the torch-function mode
    stack (``_compat.dispatch``'s adapters).
    """
    dispatch = _compat.dispatch
    recorder = _tracing.pre_dispatch_function_mode()
    popped = [dispatch.pop_torch_function_mode() for _ in range(dispatch.torch_function_modes_depth())]
    kept = [m for m in reversed(popped) if not isinstance(m, recorder)]  # bottom first
    for mode in kept:
        dispatch.push_torch_function_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            dispatch.pop_torch_function_mode()
        for mode in reversed(popped):
            dispatch.push_torch_function_mode(mode)


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
    """
    outer = _tracing.make_fx_fake_mode()
    return outer is not None and any(isinstance(a, _compat.FakeTensor) and a.fake_mode is not outer for a in args)


def _trace_fresh(fn, args, force_enable_grad):
    with contextlib.ExitStack() as stack:
        stack.enter_context(tracing_lock())
        # Functional wrappers (torch.func.functionalize, XLA) would hide the
        # body from make_fx: trace on plain stand-ins of the same metadata.
        stack.enter_context(_tracing.functionalization_suspended())
        args = [_compat._from_fun(a) for a in args]
        if force_enable_grad:
            stack.enter_context(torch.enable_grad())
        return _tracing.fake_trace(fn)(*args)


# identities on values, aten's and (in Dynamo's graphs) torch's: unread, they compute nothing
_UNREAD_IF_UNUSED = (*VALUE_IDENTITIES, torch.detach)


def _is_unread_alias(node):
    if node.users:
        return False
    if node.op == "call_method":
        return node.target == "detach"
    return node.op == "call_function" and node.target in _UNREAD_IF_UNUSED


def drop_dead_aliases(graph):
    """Dead aliases and detaches erased (chains followed: ``t.detach().detach()``, the graph
    walked from its end): (whether any was, the nodes they read that are left without users)."""
    erased, orphans = False, []
    for node in reversed(list(graph.nodes)):
        if not _is_unread_alias(node):
            continue
        source = node.args[0]
        graph.erase_node(node)
        erased = True
        if isinstance(source, torch.fx.Node) and not source.users:
            orphans.append(source)
    return erased, orphans


def _drop_unread_aliases(gm):
    """Dead aliases and detaches dropped, and the constants only they read. A closure read by
    none but them must not be lifted or kept: one traced only to read a closure's sizes
    (``_compat`` binds an outer trace's symbols with one) is dead when nothing used those sizes
    (the front end's own carry-shape check), and a body's dead ``t.detach()`` of a tensor it
    also receives as its carry (scan_model's layer views) lifted that tensor a second time, an
    input requiring grad that Dynamo's capture of the same body does not have: XLA then
    compiled a training step's program twice, once per route (``op.dynamo`` drops the same)."""
    erased, orphans = drop_dead_aliases(gm.graph)
    for source in orphans:
        if source.op == "get_attr" and not source.users:
            gm.graph.erase_node(source)
            if not gm.graph.find_nodes(op="get_attr", target=source.target) and hasattr(gm, source.target):
                delattr(gm, source.target)  # nor kept alive by the graph (see ``forget_constants``)
    if erased:
        gm.recompile()


def forget_constants(gm):
    """Drop a thrown-away graph's references to its tensor constants. An FX graph and its
    GraphModule refer to each other, so a graph no one holds lives until Python's gc runs,
    and with it the user's tensors it holds as constants (a body's closures); on XLA a live
    tensor is an output of the step's program, which then differs from the next step's."""
    for node in gm.graph.find_nodes(op="get_attr"):
        if isinstance(getattr(gm, node.target, None), torch.Tensor):
            delattr(gm, node.target)
    return gm


def _refuse_value_dependent_sizes(gm):
    """A trace may succeed on a body whose sizes depend on tensor values (``.tolist()`` split
    sizes: an MoE router's per-expert token counts); one graph for every step cannot hold them,
    and the scan then failed far from the cause (a saved SymBool stacked as a y)."""
    node = _compat.first_value_dependent_node(gm)
    if node is not None:
        raise ScanError(data_dependence_message(
            f"the traced body's {node.target} reads a tensor's value: .item(), .tolist(), nonzero() or a boolean mask"))


@contextlib.contextmanager
def _in_place_sharding_as_scan_error():
    """torch_xla's ``xs.mark_sharding`` annotates a tensor in place, on its
    device data: a traced body has none (torch_xla says "Expected XLA tensor")."""
    try:
        yield
    except RuntimeError as e:
        if not _raised_by_in_place_sharding(e):
            raise
        fsdp_v2 = (" Here it is the forward of a module wrapped by torch_xla's SpmdFullyShardedDataParallel "
                   "(FSDPv2), which annotates its output so: wrap the module that calls scan instead, or build "
                   "the wrapper with shard_output=lambda output, mesh: None and annotate the output in the "
                   "body as above (scan_layers over FSDPv2-wrapped layers does that itself)."
                   if _raised_in_fsdp_v2_forward(e) else "")
        raise ScanError(
            "scan: the body calls torch_xla's in-place xs.mark_sharding(t, mesh, spec), which annotates a "
            "tensor's device data and cannot be traced into the scan's graph. Use "
            "t = xs.mark_sharding_with_gradients(t, mesh, spec) in the body instead (the same annotation, "
            f"also on t's gradient), and shard the inputs with xs.mark_sharding outside the scan.{fsdp_v2} "
            f"(torch_xla: {str(e).splitlines()[0] if str(e) else ''})") from e


@contextlib.contextmanager
def _real_index_as_scan_error(args):
    """Under ``make_fx(tracing_mode="real")`` (its default) a body is traced on real stand-ins of
    uninitialized memory (torch's ``materialize_as_graph``): a 0-d tensor index read from them
    (``buf[:, t]``, traced as ``aten.index``) is out of range, and the real run says so."""
    try:
        yield
    except (IndexError, RuntimeError) as e:
        real = under_make_fx() and _tracing.make_fx_fake_mode() is None \
            and _compat.detect_fake_mode(args) is None
        if not real or not any(m in str(e) for m in ("out of bounds", "out of range", "out of DATA bounds")):  # index, index_select
            raise
        raise ScanError(
            "scan: under make_fx(tracing_mode='real') (make_fx's default) the body is traced on "
            "uninitialized stand-ins, so an index it reads from a tensor (buf[:, t] with a 0-d tensor t) "
            "is out of range in that real run. Trace with make_fx(..., tracing_mode='fake') or "
            f"'symbolic'. (torch: {str(e).splitlines()[0] if str(e) else type(e).__name__})") from e


@contextlib.contextmanager
def _data_dependence_as_scan_error():
    """A body that reads a tensor's value (``if c.sum() > 0``, ``.item()``,
    ``bool(flag)``) cannot become one graph: say so in the user's terms."""
    try:
        yield
    except Exception as e:
        if not _compat.is_data_dependence_error(e):
            raise
        raise ScanError(data_dependence_message(e)) from e


def data_dependence_message(detail):
    """The one message for a body that depends on tensor values, whichever path found it;
    ``detail`` is what found it: a string, or torch's exception (its first line is shown)."""
    if isinstance(detail, BaseException):
        lines = str(detail).strip().splitlines()
        detail = f"torch: {type(detail).__name__}: {lines[0] if lines else ''}"
    return (
        "scan: the body reads the value of a tensor as a Python value, so its shapes or control flow "
        "depend on a tensor's values (data-dependent: `if t.sum() > 0`, `.item()`, `bool(t)`, a Python "
        "loop over a tensor, sizes from `nonzero()`, a boolean mask or `.tolist()`, as in a "
        "mixture-of-experts router that gathers each expert's tokens), which a traced scan (make_fx, "
        "torch.compile, export, XLA) cannot capture as one graph of fixed shapes. Use torch.where / "
        "masking instead (for a router: every expert on every token, masked), or run eagerly. "
        f"({detail})")


def _functions_raised_through(error, path):
    """Names of the functions of the file ending in ``path`` that ``error`` passed through."""
    import traceback

    return [f.name for f in traceback.extract_tb(error.__traceback__)
            if f.filename.replace("\\", "/").endswith(path)]


def _raised_by_in_place_sharding(error):
    """Did ``error`` come out of torch_xla's in-place ``mark_sharding`` (the
    torch_xla 2.9 function in ``distributed/spmd/xla_sharding.py``)?"""
    frames = _functions_raised_through(error, "spmd/xla_sharding.py")
    return "mark_sharding" in frames and "_aot_mark_sharding" not in frames


def _raised_in_fsdp_v2_forward(error):
    """Did ``error`` come out of the forward of torch_xla's FSDPv2 wrapper (its default
    ``shard_output`` annotates the output in place)?"""
    return len(_functions_raised_through(error, "experimental/spmd_fully_sharded_data_parallel.py")) > 0
