"""What a scanned ``scan_layers`` asks of the layers themselves: no module hooks (the
traced body runs layer 0's code, not the modules' ``__call__``), no running statistics
updated in place, and (eager, stacked grads) whether the loop may run over the stacks; and
that one tuple input is not meant as several (torch_xla's convention).
"""
import inspect

import torch

from .. import _compat
from ..core.trees import ScanError
from .grads import registered_stacks
from .ownership import container_of


def check_no_running_stat_updates(layer):
    """A norm layer updating its running statistics in place (BatchNorm in training mode) would
    write into the scan's slice of its buffers: refused by name, not as a generic input mutation."""
    found = _running_stats_updater(layer)
    if found is not None:
        path, m = found
        stats = [n for n, b in _compat.nn.own_buffers(m).items() if b is not None]
        raise ScanError(
            f"scan_layers: {type(m).__name__} '{path or 'the layer itself'}' of layer 0 is in training mode and "
            f"updates its buffers {stats} in place, which a traced scan_layers cannot write back per layer. "
            "Put the norm layers in eval mode (.eval()), build them with track_running_stats=False, or run "
            "the stack as a plain loop.")


def _running_stats_updater(layer):
    """(path, module) of the first module in ``layer`` updating running statistics in place, else None."""
    for path, m in layer.named_modules():
        if _compat.nn.updates_running_stats(m):
            return path, m
    return None


def differentiates_stacks(container, layers):
    """Eager, stacked grads: the loop runs over the stacks' rows (autograd then sees the
    stacks: ``torch.autograd.grad`` with respect to one works, as compiled) unless a layer
    has hooks or updates running statistics (BatchNorm in training mode), which only the
    layers' own code does (their gradients are then moved into the stacks as they
    accumulate). Layer 0 speaks for the others: the caller also asks that all agree."""
    return torch.is_grad_enabled() and any(P.requires_grad for P in registered_stacks(container).values()) \
        and _hooks_message(layers) is None and _running_stats_updater(layers[0]) is None


def check_no_hooks(layers):
    """A traced scan runs the layers' code, not their ``__call__``: hooks would
    silently not run, so they are refused (eager runs them: it is the loop)."""
    message = _hooks_message(layers)
    if message:
        raise ScanError(message)


def check_no_hooks_traced(layers, token):
    """``check_no_hooks`` under Dynamo. Dynamo does not guard module hooks
    (its ``skip_nnmodule_hook_guards`` config, on by default: a hook
    added after compiling is not seen, for a compiled loop as well), so the
    check is made once, in Python, when the body is traced: walking every
    layer's modules in traced code made the trace grow with depth (~1.5 s from
    8 to 64 layers). Needs a stacked container (its token finds the layers)."""
    if token is None or not _compat.dynamo.hook_guards_skipped() or not _hook_free_when_traced(token):
        check_no_hooks(layers)  # traced: raises the ScanError naming the hooked layer


@torch.compiler.assume_constant_result  # runs in Python when traced; the token is guarded, the result not
def _hook_free_when_traced(token):
    return _hooks_message(list(container_of(token))) is None


def _hooks_message(layers):
    if _compat.global_module_hooks_registered():
        return ("scan_layers: global nn.Module hooks are registered; a traced scan_layers "
                "(torch.compile, export, XLA) does not run module hooks. Remove them or use a loop.")
    for i, layer in enumerate(layers):
        name = _hooked_submodule(layer, "")
        if name is not None:
            where = f"layer {i}" + (f" ({name})" if name else "")
            return (f"scan_layers: {where} has module hooks; a traced scan_layers (torch.compile, "
                    "export, XLA) runs layer 0's code, not the modules' __call__, so hooks would not "
                    "run. Remove them or use a Python loop.")
    return None


def _hooked_submodule(module, prefix):
    """The dotted name of the first module in ``module``'s tree with hooks ("" for
    itself), else None. A plain dict walk: Dynamo traces it once per layer, and the
    ``named_modules`` generator cost several times more to trace at depth 64."""
    if _compat.nn.module_has_hooks(module) and not _compat.distributed.only_fsdp_hooks(module):
        return prefix[:-1]  # FSDP2's hooks are done in the traced body (``layers.fsdp``)
    for name, sub in _compat.nn.child_modules(module).items():
        if sub is not None:
            found = _hooked_submodule(sub, prefix + name + ".")
            if found is not None:
                return found
    return None


def check_one_tuple_is_not_several_inputs(layer, inputs, kwargs):
    """``torch_xla.experimental.scan_layers(layers, (a, b))`` unpacks a tuple input into the layer's
    positional arguments (``torch.func.functional_call`` does); ours takes them as
    ``scan_layers(layers, a, b)`` and hands one tuple input to the layer as it is. A layer that then
    lacks positional arguments would fail inside the scan with a bare TypeError; this names the fix."""
    if len(inputs) != 1 or type(inputs[0]) is not tuple or len(inputs[0]) < 2:
        return
    try:
        params = inspect.signature(layer.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward: nothing to read
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.kind in positional and p.default is p.empty and p.name not in kwargs]
    if len(required) > 1:
        raise ScanError(f"scan_layers: the layers' forward takes {len(required)} positional inputs "
                        f"({', '.join(required)}) but got one tuple of {len(inputs[0])}; pass them as "
                        "scan_layers(layers, *inputs) (torch_xla's scan_layers unpacks a tuple input, ours does not).")
