"""Hugging Face transformers' output-capturing hooks (transformers >= 5).

transformers 5 no longer has its layers return attention weights or hidden states: a model
called with ``output_attentions`` / ``output_hidden_states`` / ``output_router_logits`` for
the first time installs, for good, a forward hook on each layer and attention module
(``transformers.utils.output_capturing.install_output_capuring_hook``). The hook does
nothing unless the model's forward is collecting that hook's key at that moment (a
context variable holding ``{key: [...]}``); when it is, it appends the module's output.

So after one such call every layer has hooks, which a traced scan_layers refuses since it
does not run hooks. These adapters let it tell the inert ones apart: a capture hook whose
key is not being collected would return at once in the loop too. Everything here reads
transformers' private names, kept in this one file.
"""
import sys

import torch

from . import dispatch, dynamo, nn

_HOOK_MODULE = "transformers.utils.output_capturing"
_HOOK_NAME = "output_capturing_hook"


def is_capture_hook(hook):
    """``hook`` is transformers' output-capturing forward hook."""
    return getattr(hook, "__module__", None) == _HOOK_MODULE and getattr(hook, "__name__", None) == _HOOK_NAME


@torch.compiler.assume_constant_result  # Dynamo: read in Python (reading a closure cell in traced code
def capture_key(hook):                   # made Dynamo fail to inline the hook later: "Expected CellVariable")
    """The output a capture hook records ("attentions", "hidden_states", ...): its closure's ``key``."""
    names = hook.__code__.co_freevars
    return hook.__closure__[names.index("key")].cell_contents if "key" in names else None


@torch.compiler.assume_constant_result  # as capture_key
def capture_index(hook):
    """Which element of a tuple output a capture hook records (its closure's ``index``)."""
    names = hook.__code__.co_freevars
    return hook.__closure__[names.index("index")].cell_contents if "index" in names else 0


def capture_hooks(module):
    """``module``'s capture hooks, in the order they run."""
    return [h for h, _ in nn.forward_hooks(module) if is_capture_hook(h)]


def collected_keys(keys):
    """Which of ``keys`` the transformers model running now collects (its forward sets the
    collector around the layers' loop; None outside a model's forward), or None when that
    cannot be read here. Read live: under Dynamo the read is traced, with a guard (a model
    compiled whole keeps the collector in a plain attribute while compiling; otherwise
    torch >= 2.15 guards the ContextVar, and an older Dynamo cannot read it: None)."""
    if not keys:
        return ()
    capturing = sys.modules.get(_HOOK_MODULE)
    if capturing is None:
        return ()
    var = capturing._active_collector
    if dispatch.is_dynamo_compiling() and not var.compiling and not dynamo.guards_context_vars():
        return None
    collector = var.get()
    if collector is None:
        return ()
    return tuple(k for k in keys if k in collector)
