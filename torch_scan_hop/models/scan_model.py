"""``scan_model``: a Hugging Face model's decoder stack run as scans, with no edit of its code."""
import inspect
from typing import TypeVar

import torch

from ..remat.policies import as_policy
from ..core.trees import ScanError
from ..layers import module_state, patterns
from ..layers.blocks import blocks_of
from ..layers.patterns import stack_plan
from . import forward_loop
from .deferred import ScannedForward, ScannedModuleList

Model = TypeVar("Model", bound=torch.nn.Module)


def scan_model(model: Model, *, remat="save_all", unroll=None) -> Model:
    """Run ``model``'s decoder layers as scans: changes the model in place and returns it.

    The model's own forward still runs (embeddings, masks, rotary positions, the final norm,
    the head, the loss); its loop over the layers becomes ``scan_layers`` over what each layer
    was given, one scan per run of identical layers or ONE scan over blocks of a repeating
    pattern (Gemma 3's 5 sliding + 1 full attention layers, Qwen3-Next's 3 linear + 1 full,
    RecurrentGemma's 2 recurrent + 1 attention), plus the layers left over, called as they are
    (``layers.patterns``). Eager it is the loop over the real layers (hooks run); under
    ``torch.compile``, ``torch.export`` and on XLA each scan is one node (one XLA While), traced
    once whatever the depth.

    The layers stay in place: ``parameters()``, ``state_dict()`` keys, optimizers,
    ``save_pretrained`` / ``from_pretrained`` of the weights, ``generate()`` and the outputs are
    unchanged. A training forward that does not pass a cache runs with ``use_cache=False`` (as
    transformers does under gradient checkpointing). A forward that fills a cache (generation)
    runs the layers one by one, as the model's loop: each layer writes its own slot of it.

    Args:
        model: a transformers ``PreTrainedModel`` (a causal LM or its base model), or any module
            whose forward (or whose ``base_model``'s) loops ``hidden = layer(hidden, ...)`` over a
            ``ModuleList``.
        remat: what the backward keeps per layer (``scan``'s ``remat``).
        unroll: layers per loop iteration (``scan``'s ``unroll``).

    Returns:
        ``model`` itself.

    Raises:
        ScanError: the model's forward does more in its loop than call each layer on the hidden
            state (the message names the family, the line and the statement), its layers are not
            a plain ``nn.ModuleList``, or ``remat`` is not a policy.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = scan_model(LlamaForCausalLM(LlamaConfig(num_hidden_layers=16)))
        >>> loss = model(ids, labels=ids).loss   # the 16 layers: one scan
        >>> scan_plan(model)
        ['layers 0-15: one scan over 16 layers']
    """
    as_policy(remat)  # a bad policy is refused now, not at the first call
    base = _base_model(model)
    family = type(base).__name__
    candidates = {name for name, m in base._modules.items() if isinstance(m, torch.nn.ModuleList)}
    shape = forward_loop.layer_loop(type(base), candidates)
    container = base._modules[shape.container]
    if type(container) not in (torch.nn.ModuleList, ScannedModuleList):
        raise ScanError(f"scan_model: {family}.{shape.container} is a {type(container).__name__}, not a plain "
                        "nn.ModuleList (stack_layers storage, a wrapper); scan_model swaps in its own container.")
    layers = list(container._modules.values())
    options = dict(remat=remat, unroll=unroll, cache_type=_cache_type(),
                   positional=tuple(_positional_names(type(layer)) for layer in layers),
                   takes_use_cache="use_cache" in inspect.signature(inspect.unwrap(type(base).forward)).parameters)
    container.__class__ = ScannedModuleList
    container.__dict__["_scan_model_options"] = options
    segments = stack_plan(container, layers, "auto")
    alike = patterns.stack_alike(container, layers)  # read now, outside any tracer
    for layer in layers:  # the names of state kept on the layers' modules, read outside any tracer
        module_state.record(layer)
    for seg in segments:
        if seg.period > 1:
            blocks_of(container, layers, seg)  # made now, outside any tracer
    options["plan"] = patterns.describe(segments, alike)
    base.forward = ScannedForward(base, shape.container, options)
    return model


def scan_plan(model):
    """How ``scan_model`` runs the model's layers: a line per scan or single layer."""
    base = _base_model(model)
    for m in base._modules.values():
        if isinstance(m, ScannedModuleList):
            return list(m.__dict__["_scan_model_options"]["plan"])
    raise ScanError(f"scan_plan: {type(base).__name__} was not prepared by scan_model.")


def _base_model(model):
    if not isinstance(model, torch.nn.Module):
        raise ScanError(f"scan_model: expected a transformers model (an nn.Module), got {type(model).__name__}.")
    base = getattr(model, "base_model", model)
    if hasattr(type(base), "get_decoder") and getattr(base, "language_model", None) is not None:
        base = base.language_model  # a multimodal wrapper (Gemma 3's): its text decoder
    return base


def _positional_names(layer_cls):
    """The names of a layer forward's positional parameters after the hidden state."""
    params = list(inspect.signature(inspect.unwrap(layer_cls.forward)).parameters.values())[1:]  # self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)[1:]


def _cache_type():
    try:
        from transformers import Cache  # noqa: PLC0415 (transformers is optional)
    except ImportError:
        return None
    return Cache
