"""Hugging Face transformers' output-capturing hooks (transformers >= 5), and (at the end) its
mixture-of-experts modules' experts implementations (``layers.experts``).

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
import functools
import inspect
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


# transformers 5's mixture-of-experts modules (``transformers.integrations.moe``): which experts
# implementation a module dispatches to, and what the installed release's implementations do,
# read from its code (features, not version numbers), for ``layers.experts``.
_MOE_MODULE = "transformers.integrations.moe"


def experts_implementation(module):
    """The experts implementation ``module`` dispatches to now ("eager", "grouped_mm",
    "batched_mm", ...), or None for a module that is no transformers experts module (one whose
    class ``use_experts_implementation`` decorated: it sets these attributes and wraps forward)."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "is_concatenated") or not hasattr(module, "has_gate") \
            or getattr(type(module).forward, "__wrapped__", None) is None:
        return None
    return getattr(config, "_experts_implementation", None)


@functools.lru_cache(maxsize=None)
def own_experts_forward_reads_routing(experts_class):
    """The experts class's own forward (the "eager" implementation) gathers each expert's tokens
    with ``nonzero()`` (a loop over the experts hit): shapes that depend on the routing."""
    try:
        source = inspect.getsource(inspect.unwrap(experts_class.forward))
    except (OSError, TypeError):
        return False
    return ".nonzero(" in source or "torch.nonzero(" in source


@functools.lru_cache(maxsize=None)
def grouped_mm_backward_reads_values():
    """transformers' fallback grouped matmul (``transformers::grouped_mm_fallback``, run where
    torch's grouped_mm cannot: under torch.compile with weights other than bfloat16) has a Python
    backward reading each expert's token count with ``.tolist()`` (transformers 5.17; later
    releases made that backward an op of its own, which traces)."""
    moe = sys.modules.get(_MOE_MODULE)
    backward = getattr(moe, "_grouped_mm_fallback_backward", None)
    try:
        return backward is not None and ".tolist()" in inspect.getsource(backward)
    except (OSError, TypeError):
        return False


def offered_experts_implementations():
    """The experts implementations the installed transformers offers (empty without them)."""
    moe = sys.modules.get(_MOE_MODULE)
    functions = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    return ("eager", *functions.keys()) if functions is not None else ()
