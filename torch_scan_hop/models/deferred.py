"""The model's loop over its layers, run as scans without editing the model's code.

While a scanned model's forward runs (``ScannedForward``), its layer container hands the loop
stand-ins (``PendingLayer``) instead of its layers. A stand-in's call records the layer's
inputs and hands the hidden state on unchanged; the last one runs the whole stack as
``scan_layers(..., layer_kwargs=<what each layer was given>, period="auto")`` and returns its
result. The loop was checked to do nothing else with the hidden state
(``models.forward_loop``), and each call is checked to receive what the previous one handed
on, so the model computes what its own loop computes.

A live cache in a layer's inputs (generation with a ``Cache``) runs the real layers one by
one instead: each layer writes its own slot of the cache (``layer_idx``), which one scanned
body cannot do; except, when the scan is traced (torch.compile, XLA), transformers' static and
dynamic caches (key/value and linear-attention layers; RecurrentGemma's states on its modules:
``layers.module_state``), whose slots the scan reads and writes as
per-layer rows (``models.stacked_cache``).
Outside the model's forward the container is the plain ModuleList it was:
iteration, indexing, ``fully_shard`` per layer and ``state_dict`` see the real layers.

The running forward is kept on a module-level stack (``_ACTIVE``): plain list operations,
which Dynamo traces as side effects, so all of this also runs inside ``torch.compile``.
"""
import torch

from ..core import route
from ..core.trees import ScanError
from ..layers.scan_layers import scan_layers
from .stacked_cache import stacked_slots

_ACTIVE = []  # the containers whose model's forward is running, innermost last


class ScannedForward:
    """The base model's ``forward`` (an instance attribute): the class's own forward, with the
    layer container handing out stand-ins while it runs. A module-level class, so that a
    pickled model unpickles. ``use_cache`` is turned off for a training forward that did not ask
    for a cache, as transformers does under gradient checkpointing (a cache filled while
    training is never read)."""

    def __init__(self, model, container_name, options):
        self.model, self.container_name, self.options = model, container_name, options

    def __call__(self, *args, **kwargs):
        model = self.model
        if (model.training and torch.is_grad_enabled() and self.options["takes_use_cache"]
                and kwargs.get("use_cache") is None and not _passes_cache(kwargs)):
            kwargs["use_cache"] = False
        _ACTIVE.append(model._modules[self.container_name])
        try:
            return type(model).forward(model, *args, **kwargs)
        finally:
            _ACTIVE.pop()


def _passes_cache(kwargs):
    return any(kwargs.get(k) is not None for k in ("cache", "past_key_values"))


class ScannedModuleList(torch.nn.ModuleList):
    """A model's layer ModuleList after ``scan_model`` (its class swapped in place: same object,
    same children, same ``state_dict`` keys). Inside its model's forward, iterating it or
    slicing it gives the stand-ins; everywhere else it is the ModuleList."""

    def __iter__(self):
        if _ACTIVE and _ACTIVE[-1] is self:
            return iter(PendingStack(self, range(len(self))))
        return super().__iter__()

    def __getitem__(self, idx):
        if isinstance(idx, slice) and _ACTIVE and _ACTIVE[-1] is self:
            return PendingStack(self, range(len(self))[idx])
        return super().__getitem__(idx)


class PendingStack:
    """The layers one pass of the model's loop runs (``indices`` of the container), as stand-ins."""

    def __init__(self, container, indices):
        self.container, self.indices = container, indices
        self.calls, self.next, self.handed, self.live_cache, self.slots = [], 0, None, False, None
        modules = list(container._modules.values())
        self.layers = [modules[i] for i in indices]

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        return iter([PendingLayer(self, k) for k in range(len(self.layers))])

    def __getitem__(self, k):
        if isinstance(k, slice):
            raise ScanError("scan_model: the model's loop slices its layers twice; scan_model runs one slice.")
        return PendingLayer(self, k)

    def call(self, k, args, kwargs):
        layer = self.layers[k]
        if k != self.next:
            raise ScanError(f"scan_model: the model called layer {self.indices[k]} where layer "
                            f"{self.indices[self.next]} was next; the scanned stack runs its layers in order, once.")
        self.next += 1
        if k == 0:
            holds = _holds_cache(args, kwargs, self.container._scan_model_options["cache_type"])
            self.slots = self._stacked_cache(args, kwargs) if holds else None
            self.live_cache = holds and self.slots is None
        if self.live_cache:
            return layer(*args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor):
            raise ScanError(f"scan_model: layer {self.indices[k]} ({type(layer).__name__}) was called without a "
                            "hidden-state tensor as its first positional input; scan_model carries that input.")
        if k > 0 and args[0] is not self.handed:
            raise ScanError(f"scan_model: layer {self.indices[k]} was given a hidden state that layer "
                            f"{self.indices[k - 1]} did not return; the model's loop changes it between layers, "
                            "which a scan of the layers cannot do.")
        if k == 0:
            self.first = args[0]
        options = self.container._scan_model_options
        self.calls.append(_named(layer, args[1:], kwargs, self.indices[k], options["positional"][self.indices[k]]))
        if k < len(self.layers) - 1:
            self.handed = args[0]
            return args[0]
        if self.slots is not None:
            key, slots = self.slots
            for call, slot in zip(self.calls, slots):
                call[key] = slot
        whole = len(self.layers) == len(self.container)
        _ACTIVE.append(None)  # the scan sees the real layers when it iterates the container
        try:
            return scan_layers(self.container if whole else self.layers, self.first, layer_kwargs=self.calls,
                               period="auto", remat=options["remat"], unroll=options["unroll"])
        finally:
            _ACTIVE.pop()

    def _stacked_cache(self, args, kwargs):
        """``(keyword, one cache twin per layer)`` for a static or dynamic cache among layer 0's
        keyword inputs when this scan is traced (``models.stacked_cache``); else None (the layers
        run one by one)."""
        if not args or not isinstance(args[0], torch.Tensor) or route.runs_the_loop([args[0]]):
            return None
        options = self.container._scan_model_options
        named = _named(self.layers[0], args[1:], kwargs, self.indices[0], options["positional"][self.indices[0]])
        key = next((name for name, v in named.items() if isinstance(v, options["cache_type"])), None)
        slots = None if key is None else stacked_slots(named[key], list(self.indices), args[0].shape[-2])
        return None if slots is None else (key, slots)


class PendingLayer:
    """Layer ``k`` of a pending stack: calling it records; attributes are the real layer's."""

    def __init__(self, stack, k):
        self.__dict__["_stack"], self.__dict__["_k"] = stack, k

    def __call__(self, *args, **kwargs):
        return self.__dict__["_stack"].call(self.__dict__["_k"], args, kwargs)

    def __getattr__(self, name):
        d = self.__dict__
        return getattr(d["_stack"].layers[d["_k"]], name)


def _named(layer, rest, kwargs, index, names):
    """The layer's inputs after the hidden state, all by name (positional ones by the forward's
    parameter ``names``, read when the model was prepared), so that every layer's inputs form one
    dict of keyword inputs."""
    if len(rest) > len(names):
        raise ScanError(f"scan_model: layer {index} ({type(layer).__name__}) was given {len(rest) + 1} positional "
                        f"inputs; its forward names {len(names) + 1}.")
    named = dict(zip(names, rest))
    for key in kwargs:
        if key in named:
            raise ScanError(f"scan_model: layer {index} got {key!r} twice.")
    named.update(kwargs)
    return named


def _holds_cache(args, kwargs, cache_type):
    """A transformers Cache among the layer's inputs (each layer writes its own slot of it)."""
    return cache_type is not None and any(isinstance(v, cache_type) for v in (*args, *kwargs.values()))
