"""``scan_layers``: a stack of identical modules run as ONE scan over their stacked weights.

The parameters and buffers of the layers are stacked (``torch.stack``, so the
gradient of each stacked tensor flows back to every layer's own ``.grad``) and
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

from ._trees import ScanError
from .api import scan


def _check_same_structure(layers):
    """Every layer must have layer 0's type, parameter/buffer names, shapes and dtypes."""
    ref = layers[0]
    ref_state = _state_meta(ref)
    for i, layer in enumerate(layers[1:], start=1):
        if type(layer) is not type(ref):
            raise ScanError(f"scan_layers: layer {i} is a {type(layer).__name__}, layer 0 a {type(ref).__name__}; "
                            "all layers must be the same module type.")
        state = _state_meta(layer)
        for name in [*ref_state, *(n for n in state if n not in ref_state)]:
            if name not in state or name not in ref_state:
                where = f"layer {i} lacks {name!r}" if name not in state else f"layer {i} has an extra {name!r}"
                raise ScanError(f"scan_layers: {where} compared to layer 0; all layers need the same "
                                "parameters and buffers.")
            if state[name] != ref_state[name]:
                (s0, d0), (s1, d1) = ref_state[name], state[name]
                raise ScanError(f"scan_layers: layer {i}'s {name!r} is {s1}/{d1} but layer 0's is {s0}/{d0}; "
                                "all layers need the same shapes and dtypes.")


def _state_meta(module):
    return {name: (tuple(t.shape), t.dtype) for name, t in _state(module)}


def _state(module):
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if b is not None)


def _stacked_state(layers):
    names = [name for name, _ in _state(layers[0])]
    per_layer = [dict(_state(layer)) for layer in layers]
    return {name: _stack([state[name] for state in per_layer]) for name in names}


def _stack(tensors):
    if tensors[0].device.type == "xla" and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _StackGatherGrad.apply(*tensors)
    return torch.stack(tensors)


class _StackGatherGrad(torch.autograd.Function):
    """torch.stack whose backward gathers each layer's gradient row instead of slicing it.

    WHY: XLA's CPU compiler spends ~5 ms per slice output; with 64 layers of 12
    parameters, the 768 slices of ``unbind`` cost 4 s of compile, more than
    the scan itself. A gather by index compiles ~6x faster.
    """

    @staticmethod
    def forward(ctx, *tensors):
        ctx.n = len(tensors)
        return torch.stack(tensors)

    @staticmethod
    def backward(ctx, grad):
        rows = _row_indices(grad.device, ctx.n)
        return tuple(grad.index_select(0, row).squeeze(0) for row in rows)


_ROWS = {}


def _row_indices(device, n):
    """One-element index tensors 0..n-1, made once per device (device data, not per-step uploads)."""
    key = (str(device), n)
    if key not in _ROWS:
        _ROWS[key] = [torch.tensor([i], device=device) for i in range(n)]
    return _ROWS[key]


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
    _check_same_structure(layers)
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

    (out, _), _ = scan(step, (hidden, tensor_kwargs), _stacked_state(layers), remat=remat, unroll=unroll)
    return out
