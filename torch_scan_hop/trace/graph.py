"""``trace_graph``: one function traced to an aten graph, with the errors a user can act on.

Every trace of a body (its forward, its joint, the checks) goes through here:
``_compat.trace_aten_graph`` does the tracing; this adds what is ours, the torch_xla
ops' autograd formulas a joint needs (``xla_formulas``) and a body that reads a
tensor's value reported as a ``ScanError`` in the user's terms.
"""
import contextlib

from .. import _compat
from ..core.trees import ScanError
from .xla_formulas import register_missing


def trace_graph(fn, args, *, force_enable_grad=False):
    """``fn(*args)`` as an aten GraphModule, traced in whatever mode is active."""
    if force_enable_grad:  # differentiating: torch_xla's custom ops need their formulas
        register_missing()
    with _data_dependence_as_scan_error(), _in_place_sharding_as_scan_error():
        gm = _compat.trace_aten_graph(fn, args, force_enable_grad=force_enable_grad)
    _refuse_value_dependent_sizes(gm)
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
        if not _compat.xla.raised_by_in_place_sharding(e):
            raise
        fsdp_v2 = (" Here it is the forward of a module wrapped by torch_xla's SpmdFullyShardedDataParallel "
                   "(FSDPv2), which annotates its output so: wrap the module that calls scan instead, or build "
                   "the wrapper with shard_output=lambda output, mesh: None and annotate the output in the "
                   "body as above (scan_layers over FSDPv2-wrapped layers does that itself)."
                   if _compat.xla.raised_in_fsdp_v2_forward(e) else "")
        raise ScanError(
            "scan: the body calls torch_xla's in-place xs.mark_sharding(t, mesh, spec), which annotates a "
            "tensor's device data and cannot be traced into the scan's graph. Use "
            "t = xs.mark_sharding_with_gradients(t, mesh, spec) in the body instead (the same annotation, "
            f"also on t's gradient), and shard the inputs with xs.mark_sharding outside the scan.{fsdp_v2} "
            f"(torch_xla: {str(e).splitlines()[0] if str(e) else ''})") from e


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
