"""``stack_layers``: stacked parameter storage for a stack of identical modules.

After ``stack_layers(model.layers)`` every layer parameter named ``name`` (say
``"qkv.weight"``) is a view, row ``i``, of ONE stacked tensor per name (shape
``(L, *shape)``), as FSDP's flat parameters are views of one flat buffer. The
per-layer ``nn.Parameter`` objects stay registered where they were (same
objects, now sharing the stacked storage), so ``state_dict`` keys,
``named_parameters()``, optimizers built before or after, ``torch.save`` and
``load_state_dict`` are unchanged: optimizers see and update the per-layer
views, which updates the stack in place. (With ``grads="stacked"`` the stacks
are the container's parameters and what optimizers train: ``layers.grads``.)

The stacked tensors themselves are kept off the module's registries (a plain
dict on the container, whose class becomes ``StackedModuleList`` /
``StackedSequential``). ``scan_layers`` scans them directly when traced: no
stack of the weights per call, and the backward writes one stacked gradient.
Autograd sees each stack as ``torch.stack`` of the layers' parameters (a graph
node built once, see ``_stack_node``), so the engine itself splits that
gradient into row views (no copy) and accumulates each into its layer's
``.grad`` with the layer's hooks, exactly as for the loop. (On XLA a hook hands
out gathered rows instead: XLA compiles slice outputs slowly.)

Staying intact: ``.to()`` / ``.double()`` / ``.cuda()`` move the stack and
re-view the layers (``_apply``); ``copy.deepcopy`` and pickling re-view too.
Replacing a layer's parameter (``layer.weight = nn.Parameter(...)``,
``load_state_dict(assign=True)``) marks the storage broken, and
``scan_layers`` falls back to stacking per call (``restack()`` re-stacks).
Every call also checks that every layer still holds its own Parameter objects
(``torch.func.functional_call`` swapping any of them, a replaced submodule;
under ``torch.compile`` answered when tracing and kept by one identity guard per
parameter, see ``intact``). Outside ``torch.compile``
the aliasing is checked too, which also catches ``layer.weight.data = ...``;
under ``torch.compile`` that one assignment is not seen (call ``restack()``).
"""
import collections

import torch

from .. import _compat
from ..core import dtensors as dt
from ..core.trees import ScanError
from . import grads as _grads
from .intact import layers_intact
from .layer_state import layer_states
from .ownership import (
    BROKEN,
    TOKEN,
    Stacked,
    is_row,
    layers_hold_their_parameters,
    track,
)


def stack_layers(layers: torch.nn.ModuleList | torch.nn.Sequential, *,
                 grads: str = "per_layer") -> torch.nn.ModuleList | torch.nn.Sequential:
    """Give ``layers`` stacked parameter storage, in place: ONE ``(L, *shape)`` tensor per name.

    Each layer's parameter becomes a row view of its stack, so a traced ``scan_layers`` scans
    the stacks themselves and its first compile no longer grows with the depth, while the
    per-layer ``nn.Parameter`` objects stay (optimizers, ``state_dict()`` keys, ``torch.save``,
    ``copy.deepcopy`` and ``.to()`` keep working). Replacing a layer's parameter makes
    ``scan_layers`` stack per call again; ``layers.restack()`` re-stacks.

    Args:
        layers: an ``nn.ModuleList`` or ``nn.Sequential`` of identical modules (type, parameter
            names, shapes and dtypes), on one device. Stacked already: re-stacked with ``grads``.
        grads: "per_layer" (each layer parameter gets its ``.grad``; optimizers train the
            layers' parameters) or "stacked" (the stacks become registered parameters of the
            container, ``stacked__<name>``, with one ``.grad`` per name, which optimizers
            train; see ``layers.grads``).

    Returns:
        ``layers`` itself, now a ``StackedModuleList`` / ``StackedSequential``.

    Raises:
        ScanError: another container, layers that differ, parameters on several devices or
            DTensor parameters (``fully_shard``, ``parallelize_module``), or a bad ``grads``.

    Example:
        >>> import torch
        >>> from torch_scan_hop import scan_layers, stack_layers
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        >>> layers = stack_layers(layers)
        >>> h = scan_layers(layers, torch.randn(2, 8))
        >>> type(layers).__name__, tuple(h.shape)
        ('StackedModuleList', (2, 8))
    """
    _grads.check_mode(grads)
    if isinstance(layers, _StackedMixin):
        layers.__dict__["_scan_grads"] = grads
        layers.restack()
        return layers
    cls = _STACKED_CLASSES.get(type(layers))
    if cls is None:
        raise ScanError(f"stack_layers: expected an nn.ModuleList or nn.Sequential, got {type(layers).__name__}.")
    mods = list(layers)
    if mods:
        layer_states(mods)  # same types, names, shapes and dtypes, or a ScanError naming layer and parameter
        devices = {p.device for m in mods for p in m.parameters()}
        if len(devices) > 1:
            raise ScanError(f"stack_layers: the layers' parameters are on several devices {sorted(map(str, devices))}.")
        if any(dt.is_dtensor(p) for m in mods for p in m.parameters()):
            raise ScanError("stack_layers: the layers' parameters are DTensors (fully_shard, parallelize_module); "
                            "their storage is the sharding's. Call scan_layers on the layers without stack_layers "
                            "(under torch.compile it stacks the local shards and gathers each layer in its step).")
    layers.__class__ = cls
    layers.__dict__["_scan_grads"] = grads
    layers.restack()
    return layers


class _StackedMixin(Stacked):
    """The container side of stacked storage (mixed into ModuleList / Sequential)."""

    def restack(self):
        """(Re)build one stacked tensor per parameter name from the layers' current
        parameters and make every layer's parameter a row view of it."""
        mods = list(self)
        stacked = {}
        if mods:
            owners = _owners(mods)
            for name, where in owners.items():
                ps = [m._parameters[leaf] for m, leaf in where]
                with torch.no_grad():
                    P = torch.stack([p.detach() for p in ps])
                stacked[name] = P
            if self.grads_mode == "stacked":
                stacked = _grads.register_stacks(self, stacked, owners)
            else:
                _grads.drop_stacks(self)
            self.__dict__["_scan_stacked"] = stacked
            self.__dict__["_scan_owners"] = owners
            self._rebind()
        else:
            _grads.drop_stacks(self)
            self.__dict__["_scan_stacked"], self.__dict__["_scan_owners"] = {}, {}
        self.__dict__[BROKEN] = False
        track(self)
        return self

    def _rebind(self):
        """Point every layer parameter at its row of the stack (keeps the Parameter objects)
        and make the tensors ``scan_layers`` feeds to the scan (``_scan_fed``)."""
        self.__dict__["_scan_ids"] = {name: tuple(id(m._parameters[leaf]) for m, leaf in where)
                                      for name, where in self._scan_owners.items()}
        fed = {}
        for name, P in self._scan_stacked.items():
            params = [m._parameters[leaf] for m, leaf in self._scan_owners[name]]
            rows = P.detach()
            for i, p in enumerate(params):
                p.data = rows[i]
            if P.device.type == "xla":  # rows start as pending slices: the first step's graph would differ
                _compat.xla.materialize([P, *params])
            if self.grads_mode == "stacked" or not (P.is_floating_point() or P.is_complex()):
                fed[name] = P
            elif P.device.type == "xla":
                P.requires_grad_(True)
                _grads.register_xla_hand_out(self, name, P)
                fed[name] = P
            else:
                fed[name] = _stack_node(params, P)
        self.__dict__["_scan_fed"] = fed
        if self.grads_mode == "stacked":
            _grads.route_layer_grads(self)
        else:
            _grads.unroute_layer_grads(self)

    @property
    def grads_mode(self):
        """"per_layer" or "stacked" (see ``stack_layers``)."""
        return self.__dict__.get("_scan_grads", "per_layer")

    # A layer added, removed or replaced (append, extend, insert, ``layers[i] = m``, del, pop): the
    # stacks no longer match the layers, so scan_layers stacks per call until ``restack()``.
    def _layers_edited(self):
        if "_scan_stacked" in self.__dict__:
            self.__dict__[BROKEN] = True

    def __setattr__(self, name, value):
        if name == "_modules" or isinstance(value, torch.nn.Module):
            self._layers_edited()
        super().__setattr__(name, value)

    def __delattr__(self, name):
        if name in self._modules:
            self._layers_edited()
        super().__delattr__(name)

    def add_module(self, name, module):
        self._layers_edited()
        super().add_module(name, module)

    def insert(self, index, module):  # writes ``_modules`` directly
        self._layers_edited()
        return super().insert(index, module)

    def stacked_parameters(self):
        """``{name: stacked tensor}`` (read-only use: the layers' parameters are its rows)."""
        return dict(self._scan_stacked)

    def stacked_inputs(self):
        """``{name: the stack as autograd sees it}``: ``torch.stack`` of the layers'
        parameters, same storage (``torch.autograd.grad`` of it is the stacked gradient)."""
        return dict(self._scan_fed)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.__dict__.get("_scan_stacked") and self.grads_mode == "stacked":
            self.__dict__["_scan_stacked"] = _grads.registered_stacks(self)  # moved as parameters
            self._rebind()
        elif self.__dict__.get("_scan_stacked"):
            new = {}
            with torch.no_grad():
                for name, P in self._scan_stacked.items():
                    new[name] = fn(P.detach())
            self.__dict__["_scan_stacked"] = new
            self._rebind()
        return out

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_scan_stacked"] = {k: v.detach() for k, v in state.get("_scan_stacked", {}).items()}
        if state.get("_scan_grads") == "stacked":
            state.pop("_scan_stacked")  # the registered parameters are the stacks
        state.pop("_scan_owners", None)
        state.pop("_scan_ids", None)
        state.pop("_scan_fed", None)  # a graph node: rebuilt by _rebind
        state.pop(TOKEN, None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        mods = list(self)
        self.__dict__["_scan_owners"] = _owners(mods) if mods else {}
        # the per-layer parameters are the truth (a deepcopy clones them apart from the stack):
        # copy them into the stack and re-view; after torch.load they already alias it.
        if self.grads_mode == "stacked":
            self.__dict__["_scan_stacked"] = _grads.registered_stacks(self)
        stacked = self.__dict__.get("_scan_stacked", {})
        with torch.no_grad():
            for name, P in stacked.items():
                for i, (m, leaf) in enumerate(self._scan_owners[name]):
                    p = m._parameters[leaf]
                    if not is_row(p, P, i):
                        P[i].copy_(p.detach())
        self._rebind()
        self.__dict__.setdefault(BROKEN, False)
        track(self)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _grads.drop_from_state_dict(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, *rest):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *rest)
        _grads.forgive_missing(self, prefix, missing_keys)


class StackedModuleList(_StackedMixin, torch.nn.ModuleList):
    """An ``nn.ModuleList`` whose layers' parameters live stacked (see ``stack_layers``)."""


class StackedSequential(_StackedMixin, torch.nn.Sequential):
    """An ``nn.Sequential`` whose layers' parameters live stacked (see ``stack_layers``)."""


_STACKED_CLASSES = {torch.nn.ModuleList: StackedModuleList, torch.nn.Sequential: StackedSequential}


def _owners(mods):
    """``{name: [(owning submodule, leaf name) per layer]}`` for every parameter name whose
    tensor is its own in every layer. A Parameter met more than once (a module shared by the
    layers, weights tied under two names) cannot be one row of one stack per name: its rows
    would be copies that updates of the one Parameter never reach. Such names are left out;
    ``scan_layers`` stacks them per call, and autograd sums their gradient."""
    out, uses = {}, collections.Counter()
    for layer in mods:
        for name, (m, leaf) in _param_owners(layer, "", {}).items():
            out.setdefault(name, []).append((m, leaf))
            uses[id(m._parameters[leaf])] += 1
    return {name: where for name, where in out.items()
            if all(uses[id(m._parameters[leaf])] == 1 for m, leaf in where)}


def _param_owners(module, prefix, out):
    for name, p in module._parameters.items():
        if p is not None:
            out[prefix + name] = (module, name)
    for name, sub in module._modules.items():
        if sub is not None:
            _param_owners(sub, prefix + name + ".", out)
    return out


def _stack_node(params, P):
    """``P`` as autograd sees ``torch.stack(params)``: same storage, and a ``StackBackward0``
    node whose edges lead to every parameter's own AccumulateGrad. The backward then hands
    each layer its gradient row in C++ (a view, stolen by AccumulateGrad: no copy), with
    ``register_hook`` / post-accumulate hooks, ``.grad`` accumulation and
    ``torch.autograd.grad(loss, layer.weight)`` / ``backward(inputs=...)`` as for the loop (a
    hook on a leaf stack could do none of the last two; it cost about as much). The node
    saves no tensors, so every step's backward can run through it. Edges go to every
    parameter, a frozen one included (made to require grad while stacking): AccumulateGrad
    skips a parameter that does not require grad when the backward runs, so freezing and
    unfreezing need no rebuild. Built once per (re)stack; the one copy ``torch.stack``
    makes is then dropped."""
    frozen = [p for p in params if not p.requires_grad]
    try:
        for p in frozen:
            p.requires_grad_(True)
        with torch.inference_mode(False), torch.enable_grad():
            node = torch.stack(params)
    finally:
        for p in frozen:
            p.requires_grad_(False)
    with torch.no_grad():
        node.data = P
    return node


# --- used by scan_layers ---------------------------------------------------------------

def stacked_storage(layers):
    """The container's ``{name: stacked tensor as fed to the scan}`` when its storage is
    intact, else None."""
    if not isinstance(layers, _StackedMixin):
        return None
    d = layers.__dict__
    if d.get(BROKEN, True):
        return None
    stacked = d["_scan_fed"]
    # stacked grads: the registered parameters as they are now (functional_call may swap one)
    fed = _grads.registered_stacks(layers) if layers.grads_mode == "stacked" else stacked
    if _compat.is_dynamo_compiling():  # answered when tracing, kept by guards
        return fed if layers_intact(layers) else None
    # outside Dynamo also cheap pointer checks, catching `.data =` too
    if not layers_hold_their_parameters(list(layers), d["_scan_ids"], stacked, check_rows=True):
        return None
    if layers.grads_mode == "stacked":
        message = _grads.flags_message(layers)
        if message is not None:
            raise ScanError(message)
    return fed


