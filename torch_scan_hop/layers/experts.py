"""transformers' mixture-of-experts modules in a traced scan: an experts implementation whose
shapes depend on the routing is refused by name, with the implementation that traces.

transformers 5 runs a MoE layer's experts through an implementation chosen per model
(``config._experts_implementation``; ``model.set_experts_implementation(...)``):

- "eager": the experts class's own forward, a loop over the experts some token was routed to
  (``nonzero()``): how many, and how many tokens each, depend on the routing;
- "grouped_mm": tokens sorted by expert, one grouped matmul; its forward traces. Where torch's
  grouped_mm cannot run (under torch.compile with weights other than bfloat16) transformers falls
  back to its own op, whose backward is, in transformers 5.17, Python reading each expert's
  token count with ``.tolist()`` (later releases made it an op that traces);
- "batched_mm": each token's chosen experts' weights gathered, batched matmuls: fixed shapes.

A traced scan (torch.compile, export, XLA) meeting the first two would fail deep in its trace,
as a graph break on ``nonzero`` or the generic data-dependence message, naming neither the
layer nor the fix. So before the scan the layer's experts are asked (``check_experts_trace``),
and the ScanError names the module, the implementation, why, and what traces. The scan does not
switch the implementation itself: batched_mm computes the same (up to rounding), but it holds a
copy of an expert's weights per token and chosen expert, a memory cost the user chooses
(``set_experts_implementation``); eager scans (the loop) run any implementation. What the
installed transformers does is read from its code, not its version number (``_compat.transformers``).
"""
import torch

from .. import _compat
from ..core.trees import ScanError

_TRACES = "batched_mm"  # the implementation free of data-dependent shapes in every release checked


def check_experts_trace(layer, grad_enabled, compiling):
    """Raises a ScanError naming ``layer``'s first experts module whose implementation a traced
    scan cannot capture (see the module docstring). ``layer``: layer 0 (the layers scanned together
    share their config); ``grad_enabled``: the step's grad mode (its gradient is traced when the
    experts' weights also require grad); ``compiling``: under torch.compile (Dynamo). A module-level
    function returning None: under Dynamo it runs at trace time (``layers.trace_time``)."""
    for path, module in layer.named_modules():
        implementation = _compat.transformers.experts_implementation(module)
        if implementation is None:
            continue
        needs_grad = grad_enabled and any(p.requires_grad for p in module.parameters())
        why = _why(module, implementation, needs_grad, compiling)
        if why is not None:
            raise ScanError(_message(path, module, implementation, why))


def _why(module, implementation, needs_grad, compiling):
    if implementation == "eager" and _compat.transformers.own_experts_forward_reads_routing(type(module)):
        return ("its forward loops over the experts some token was routed to (nonzero()): how many, and "
                "each one's tokens, depend on the routing")
    if implementation == "grouped_mm" and needs_grad and compiling and _weights_dtype(module) != torch.bfloat16 \
            and _compat.transformers.grouped_mm_backward_reads_values():
        return ("under torch.compile with weights other than bfloat16 it falls back to transformers' own grouped "
                "matmul, whose backward in this transformers reads each expert's token count with .tolist()")
    return None


def _weights_dtype(module):
    return next((p.dtype for p in module.parameters(recurse=False)), None)


def _message(path, module, implementation, why):
    offered = _compat.transformers.offered_experts_implementations()
    fix = (f'set an implementation that traces before scanning: model.set_experts_implementation("{_TRACES}") '
           f'(or from_pretrained(..., experts_implementation="{_TRACES}"); each token\'s chosen experts\' weights '
           "gathered: the same values up to rounding, more memory), or run the layers eagerly" if _TRACES in offered
           else "run the layers eagerly")
    where = f"experts module {path!r}" if path else "experts module"
    return (f"scan_layers: the layers' {where} ({type(module).__name__}) runs transformers' experts "
            f"implementation {implementation!r}, which a traced scan (torch.compile, export, XLA) cannot capture as "
            f"one graph of fixed shapes: {why}. To scan them traced, {fix}.")
