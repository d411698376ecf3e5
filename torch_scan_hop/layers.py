"""``scan_layers``: a stack of identical modules run as ONE scan over their stacked weights.

The parameters and buffers of the layers are stacked (``stack_weights``: a stack
whose gradient flows back to every layer's own ``.grad``) and
scanned over; the body calls the first layer's code on one layer's slice
through a read-only view (``_LayerView``). The traced body therefore does not depend on
the depth: one trace, one compile, for 8 or 64 layers.

Broadcast keyword inputs (attention masks, positions) reach every layer
unchanged. Tensor ones ride in the carry rather than being closed over, so a
new mask per batch is a new input, not a new function (no re-trace).
"""
import functools
import types

import torch

from ._stack_weights import stack_weights
from ._trees import ScanError
from .api import scan


def _layer_states(layers):
    """Each layer's ``{name: parameter or buffer}``, checked against layer 0's.

    Every layer must have layer 0's type and the same names, shapes and
    dtypes. Written as plain dict walks rather than ``named_parameters()``:
    Dynamo traces this once per layer, and the generator machinery of
    ``named_parameters`` cost ~0.1 s per layer to trace (6 s at depth 64).
    """
    states = [_state(layer, "", {}) for layer in layers]
    ref, ref_state = layers[0], states[0]
    for i in range(1, len(layers)):
        layer, state = layers[i], states[i]
        if type(layer) is not type(ref):
            raise ScanError(f"scan_layers: layer {i} is a {type(layer).__name__}, layer 0 a {type(ref).__name__}; "
                            "all layers must be the same module type.")
        if set(state) != set(ref_state):
            _raise_name_mismatch(i, state, ref_state)
        for name, t in state.items():
            t0 = ref_state[name]
            if t.shape != t0.shape or t.dtype != t0.dtype:
                raise ScanError(f"scan_layers: layer {i}'s {name!r} is {tuple(t.shape)}/{t.dtype} but layer 0's "
                                f"is {tuple(t0.shape)}/{t0.dtype}; all layers need the same shapes and dtypes.")
    return states


def _raise_name_mismatch(i, state, ref_state):
    name = next(n for n in [*ref_state, *state] if n not in state or n not in ref_state)
    where = f"layer {i} lacks {name!r}" if name not in state else f"layer {i} has an extra {name!r}"
    raise ScanError(f"scan_layers: {where} compared to layer 0; all layers need the same parameters and buffers.")


def _state(module, prefix, out):
    for name, p in module._parameters.items():
        if p is not None:
            out[prefix + name] = p
    for name, b in module._buffers.items():
        if b is not None:
            out[prefix + name] = b
    for name, sub in module._modules.items():
        if sub is not None:
            _state(sub, prefix + name + ".", out)
    return out


def _stacked_state(states):
    return {name: stack_weights([state[name] for state in states]) for name in states[0]}


class _LayerView:
    """Layer 0 seen with one layer's slice of the stacked weights.

    Attribute reads resolve to the slice (parameters, buffers), to views of
    submodules, to methods of the module's class bound to the view, or else to
    the module's own attributes. Nothing is written to the module, so the body
    has no side effects (which Dynamo refuses inside a scan body) and no
    parameter swapping per step. Module hooks are not run. (State is read via
    ``self.__dict__``, which Dynamo traces on objects created in the body.)
    """

    def __init__(self, module, state, prefix=""):
        self.m, self.state, self.prefix = module, state, prefix

    def __getattr__(self, name):
        d = self.__dict__
        if "m" not in d:  # Dynamo probing a not-yet-initialized stand-in
            raise AttributeError(name)
        module, state, prefix = d["m"], d["state"], d["prefix"]
        if prefix + name in state:
            return state[prefix + name]
        if name in module._modules:
            sub = module._modules[name]
            return None if sub is None else _LayerView(sub, state, prefix + name + ".")
        if name == "_modules":
            return {k: getattr(self, k) for k in module._modules}
        attr = getattr(type(module), name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if isinstance(attr, types.FunctionType):  # a method: bound to the view (partial: Dynamo traces it)
            return functools.partial(attr, self)
        return getattr(module, name)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __iter__(self):  # containers (Sequential, ModuleList) iterate their children
        return iter(self._modules.values())

    def __len__(self):
        module = self.__dict__.get("m")
        return 0 if module is None else len(module._modules)

    def __bool__(self):  # a module is truthy whatever its number of children
        return True

    def __getitem__(self, idx):
        return list(self._modules.values())[idx]


def _split_kwargs(kwargs):
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    static = {k: v for k, v in kwargs.items() if k not in tensors}
    return tensors, static


def scan_layers(layers, *inputs, remat="save_all", unroll=1, **broadcast_kwargs):
    """``for layer in layers: inputs = layer(*inputs, **broadcast_kwargs)`` as one scan.

    ``layers``: an ``nn.ModuleList`` (or sequence) of modules with identical
    structure. With one input the layers map a tensor (or pytree) to the same
    structure; with several, each layer takes them all and returns a tuple of
    the same structure. Returns what the last layer returns. Gradients land
    on each layer's own parameters.
    """
    layers = list(layers)
    if not layers:
        raise ScanError("scan_layers: layers is empty; pass at least one module.")
    if not all(isinstance(m, torch.nn.Module) for m in layers):
        raise ScanError("scan_layers: every element of layers must be an nn.Module.")
    if not inputs:
        raise ScanError("scan_layers: pass the hidden state as a positional input: scan_layers(layers, x).")
    states = _layer_states(layers)
    template = layers[0]
    tensor_kwargs, static_kwargs = _split_kwargs(broadcast_kwargs)
    hidden = inputs[0] if len(inputs) == 1 else tuple(inputs)
    single = len(inputs) == 1

    def step(carry, params):
        h, kw = carry
        args = (h,) if single else tuple(h)
        out = _LayerView(template, params)(*args, **kw, **static_kwargs)
        if not single and isinstance(out, list):
            out = tuple(out)
        return (out, kw), None

    (out, _), _ = scan(step, (hidden, tensor_kwargs), _stacked_state(states), remat=remat, unroll=unroll)
    return out
