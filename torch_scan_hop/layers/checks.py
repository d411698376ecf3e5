"""What a scanned ``scan_layers`` asks of the layers themselves: no module hooks (the
traced body runs layer 0's code, not the modules' ``__call__``), no running statistics
updated in place, and (eager, stacked grads) whether the loop may run over the stacks; and
that one tuple input is not meant as several (torch_xla's convention).
"""
import inspect

import torch

from .. import _compat
from ..core.trees import ScanError
from . import trace_time
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
    silently not run, so they are refused (eager runs them: it is the loop).
    transformers' output-capturing hooks pass: returns the keys of theirs that a model
    collects now, which the traced body then records (``layers.capture``)."""
    message, keys = _traced_hooks(layers)
    if message:
        raise ScanError(message)
    return collected_now(keys)


def check_no_hooks_traced(layers, token):
    """``check_no_hooks`` under Dynamo. Dynamo does not guard module hooks
    (its ``skip_nnmodule_hook_guards`` config, on by default: a hook
    added after compiling is not seen, for a compiled loop as well), so the
    check is made once, in Python, when the body is traced: walking every
    layer's modules in traced code made the trace grow with depth (~1.5 s from
    8 to 64 layers). A stacked container's token finds the layers; any other
    stack is walked by Dynamo's tracker at trace time (``trace_time``).
    Whether transformers collects outputs is read in traced code: it changes
    from call to call (a guard), the hooks do not."""
    keys = None
    if token is not None and _compat.dynamo.hook_guards_skipped():
        keys = _capture_keys_when_traced(token)
    if keys is None and _compat.dynamo.hook_guards_skipped():  # any stack: the walk in Python at trace time
        answer = trace_time.ask(_traced_hooks, None, list(layers))
        if answer is not None:
            message, keys = answer
            if message:
                raise ScanError(message)
    if keys is None:
        return check_no_hooks(layers)  # traced: raises the ScanError naming the hooked layer
    return collected_now(keys)


@torch.compiler.assume_constant_result  # runs in Python when traced; the token is guarded, the result not
def _capture_keys_when_traced(token):
    """The inert-when-idle capture hooks' keys of the token's layers, None if any other hook."""
    message, keys = _traced_hooks(list(container_of(token)))
    return None if message else keys


def collected_now(keys):
    """Which of the layers' capture hook ``keys`` a transformers model collects now."""
    collected = _compat.transformers.collected_keys(keys)
    if collected is None:
        raise ScanError(
            f"scan_layers: the layers carry transformers' output-capturing hooks ({list(keys)}); under "
            "torch.compile this torch (before 2.15) cannot read whether a model collects those outputs now, "
            "so a compiled scan_layers could leave them empty. Compile the whole model (its forward then sets "
            "what it collects where Dynamo reads it), use torch >= 2.15, or run the layers eagerly.")
    return collected


def _hooks_message(layers):
    """Why the layers cannot run without their hooks, counting every hook (eager: the stacks'
    rows may only replace the layers' own calls when no hook would be skipped)."""
    return _traced_hooks(layers, capture_ok=False)[0]


def _traced_hooks(layers, capture_ok=True):
    """(why the layers' hooks stop a traced scan or None, the keys of the transformers capture
    hooks passed over: inert unless their model collects them, checked per call)."""
    if _compat.global_module_hooks_registered():
        return ("scan_layers: global nn.Module hooks are registered; a traced scan_layers "
                "(torch.compile, export, XLA) does not run module hooks. Remove them or use a loop."), ()
    keys = [] if capture_ok else None
    for i, layer in enumerate(layers):
        name = _hooked_submodule(layer, "", keys)
        if name is not None:
            where = f"layer {i}" + (f" ({name})" if name else "")
            return (f"scan_layers: {where} has module hooks; a traced scan_layers (torch.compile, "
                    "export, XLA) runs layer 0's code, not the modules' __call__, so hooks would not "
                    "run. Remove them or use a Python loop."), ()
    return None, tuple(sorted(set(keys or ())))


def _hooked_submodule(module, prefix, keys=None):
    """The dotted name of the first module in ``module``'s tree with a hook a traced
    scan_layers cannot stand in for ("" for itself), else None; with a ``keys`` list,
    transformers' capture hooks are passed over and their keys added to it. A plain dict
    walk: Dynamo traces it once per layer, and the ``named_modules`` generator cost
    several times more to trace at depth 64."""
    if _compat.nn.module_has_hooks(module) and not _stood_in_for(module, keys):
        return prefix[:-1]
    for name, sub in _compat.nn.child_modules(module).items():
        if sub is not None:
            found = _hooked_submodule(sub, prefix + name + ".", keys)
            if found is not None:
                return found
    return None


def _stood_in_for(module, keys):
    """Whether a traced scan_layers does what every hook of ``module`` does, hook by hook
    (a module may hold several kinds: an FSDP2-sharded transformers layer has both):
    FSDP2's are done in the body (``layers.fsdp``); tensor parallelism's layout hooks are
    run by the body's view of the module; torch_xla FSDPv2's optimization barrier is a
    fusion hint that changes no value; transformers' capture hooks, with a
    ``keys`` list, are recorded (``layers.capture``; their keys added to ``keys``); any
    other hook would silently not run."""
    found = []
    for kind, hook in _compat.nn.module_hooks(module):
        if _compat.distributed.is_fsdp_hook(hook):
            continue
        if kind in ("forward", "forward_pre") and _compat.distributed.is_tensor_parallel_hook(hook):
            continue  # run by the body's view of the module (layers.view)
        if kind == "backward" and _compat.xla.is_fsdp_v2_barrier_hook(hook):
            continue  # FSDPv2's optimization barrier: a fusion hint, no effect on values (layers.view)
        if keys is None or kind != "forward" or not _compat.transformers.is_capture_hook(hook):
            return False
        found.append(_compat.transformers.capture_key(hook))
    if found:
        keys.extend(found)
    return True


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
