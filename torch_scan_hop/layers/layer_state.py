"""What a stack of layers holds, and what its layers must agree on.

``layer_states``: each layer's ``{name: parameter or buffer}``, checked against
layer 0's (type, names, shapes, dtypes). ``check_peers_agree``: a plain attribute
the scanned body reads has one value in every layer (the body runs layer 0's code).
Used by ``scan_layers`` when it stacks per call and by ``stack_layers`` when it
stacks once.
"""
import functools
import types

import torch

from .. import _compat
from ..core import dtensors as dt
from ..core.trees import ScanError
from . import trace_time


def layer_states(layers):
    """Each layer's ``{name: parameter or buffer}``, checked against layer 0's.

    Every layer must have layer 0's type and the same names, shapes and
    dtypes. Written as plain dict walks rather than ``named_parameters()``:
    Dynamo traces this once per layer, and the generator machinery of
    ``named_parameters`` cost ~0.1 s per layer to trace (6 s at depth 64).
    Under Dynamo the walk and the check run in Python at trace time
    (``trace_time``), and the traced code only fetches each tensor by its path:
    the simulated walk still cost ~0.3 s per Gemma 3 layer.
    """
    if _compat.is_dynamo_compiling():
        paths = trace_time.ask(_state_paths, None, list(layers))
        if paths is not None:
            return [{name: _compat.nn.state_tensor(layer, path, is_param) for name, path, is_param in paths}
                    for layer in layers]
    return _checked_states(layers)


def _state_paths(layers):
    """``((name, path, is_parameter), ...)`` of layer 0's state, in ``layer_state``'s order, after the
    check of every layer against it (a ScanError as ``layer_states`` raises it)."""
    states = _checked_states(layers)
    params = {name for name, _ in _named_parameters(layers[0], "")}
    return tuple((name, tuple(name.split(".")), name in params) for name in states[0])


def _named_parameters(module, prefix):
    for name, p in _compat.nn.own_parameters(module).items():
        if p is not None:
            yield prefix + name, p
    for name, sub in _compat.nn.child_modules(module).items():
        if sub is not None:
            yield from _named_parameters(sub, prefix + name + ".")


def _checked_states(layers):
    states = [layer_state(layer, "", {}) for layer in layers]
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


def check_sharded_alike(states):
    """Traced, the layers' DTensor weights are stacked by their local shards: every layer's
    must be sharded as layer 0's (eager runs the loop, which needs no such thing)."""
    ref = states[0]
    for i in range(1, len(states)):
        for name, t in states[i].items():
            t0 = ref[name]
            if dt.is_dtensor(t) != dt.is_dtensor(t0) or dt.is_dtensor(t) and _sharded_unlike(t, t0):
                raise ScanError(f"scan_layers: layer {i}'s {name!r} is {_sharding(t)} but layer 0's is "
                                f"{_sharding(t0)}; a traced scan_layers stacks the layers' local shards, so all "
                                "layers need their weights sharded alike (the same parallelize_module plan or "
                                "fully_shard on every layer).")


def _sharded_unlike(t, t0):
    return tuple(t.placements) != tuple(t0.placements) or t.device_mesh is not t0.device_mesh \
        and t.device_mesh != t0.device_mesh


def _sharding(t):
    return f"a DTensor placed {tuple(t.placements)}" if dt.is_dtensor(t) else "a plain tensor"


MISSING = object()


_PLAIN = (int, float, bool, str, type(None))


def _is_plain(value):
    return type(value) in _PLAIN or type(value) is tuple and all(type(v) in _PLAIN for v in value)


def check_peers_agree(name, value, others, labels=None):
    """A plain attribute ``value`` of the scanned layer against the same attribute of each peer
    (``others``): a difference is a ScanError naming the peer, as ``labels[i]`` when given (the
    layer itself ``labels[0]``: a nested run's layers by their place in the stack), else layer i."""
    n, kind = len(others), type(value)
    if _is_plain(value) and [type(o) for o in others].count(kind) == n and others.count(value) == n:
        return  # all equal, found with no call per layer (each costs Dynamo a trace, 64 at depth 64)
    labels = labels or [f"layer {i}" for i in range(n + 1)]
    for i, other in enumerate(others, start=1):
        if not same_value(other, value) and _both_tensors_alike(value, other):
            raise ScanError(
                f"scan_layers: {labels[i]}'s attribute {name!r} is a plain tensor (not a parameter or buffer) "
                f"and not {labels[0]}'s, though alike ({_show(value)}, {value.dtype}); the scanned body runs "
                f"{labels[0]}'s code with its attributes, and a plain tensor is the same attribute only as the "
                "same object (values are not compared, nor guarded on later calls): "
                f"register it as a buffer in each layer (self.register_buffer({name.rsplit('.', 1)[-1]!r}, t, "
                "persistent=False): then every layer's is used), or give every layer the same tensor object.")
        if not same_value(other, value):
            raise ScanError(
                f"scan_layers: {labels[i]}'s attribute {name!r} is {_show(other)} but {labels[0]}'s is "
                f"{_show(value)}; the scanned body runs {labels[0]}'s code with its attributes, so all "
                "layers must agree on the ones it reads (keep per-layer values in parameters or buffers, "
                "or use a Python loop)." + _per_layer_function_hint(value, other))


def _both_tensors_alike(a, b):
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device)


def _per_layer_function_hint(value, other):
    if not (type(value) is type(other) is types.FunctionType and value.__code__ is other.__code__):
        return ""
    return (" Under torch.compile a function made per layer (a lambda or nested def in __init__) is "
            "the same only as the same object: assign one function to every layer.")


def same_value(a, b, depth=0):
    """Would layer 0's ``a`` act as the other layer's ``b``? Equal values, or the same callable
    built per layer: Hugging Face activations hold a ``functools.partial(gelu, approximate="tanh")``
    made in each layer's ``__init__`` (Gemma, Starcoder2), and ``partial`` has no ``==``. ``depth``
    bounds the walk into callables (a function whose closure holds itself)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False  # a plain tensor attribute per layer: only the same tensor is the same
    if depth < 4 and type(a) is functools.partial and type(b) is functools.partial:
        return _same_partial(a, b, depth + 1)
    if depth < 4 and type(a) is types.FunctionType and type(b) is types.FunctionType:
        # Dynamo cannot read closure cells, and would not guard a comparison made outside its
        # trace: under torch.compile only the same function object is the same
        return not _compat.is_dynamo_compiling() and _same_function(a, b, depth + 1)
    try:
        same = a == b
        return same if isinstance(same, bool) else False
    except Exception:  # an object without a usable ==: only identity counts
        return False


def _same_all(xs, ys, depth):
    return len(xs) == len(ys) and all(same_value(x, y, depth) for x, y in zip(xs, ys))


def _same_partial(a, b, depth):
    return (same_value(a.func, b.func, depth) and _same_all(a.args, b.args, depth)
            and sorted(a.keywords) == sorted(b.keywords)
            and all(same_value(a.keywords[k], b.keywords[k], depth) for k in a.keywords))


def _same_function(a, b, depth):
    """One ``def`` or ``lambda`` made per layer: the same code, globals and defaults, and closures
    holding the same values (a closure over the layer itself is not: the layers differ)."""
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    return (a.__code__ is b.__code__ and a.__globals__ is b.__globals__
            and _same_all(a.__defaults__ or (), b.__defaults__ or (), depth)
            and same_value(a.__kwdefaults__, b.__kwdefaults__, depth)
            and _same_all([_cell(c) for c in cells_a], [_cell(c) for c in cells_b], depth))


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return MISSING


def _show(v):
    if isinstance(v, torch.Tensor):  # no repr: under Dynamo a tensor has no value to print
        return f"a tensor of shape {list(v.shape)}"
    return "missing" if v is MISSING else repr(v)


def _raise_name_mismatch(i, state, ref_state):
    name = next(n for n in [*ref_state, *state] if n not in state or n not in ref_state)
    where = f"layer {i} lacks {name!r}" if name not in state else f"layer {i} has an extra {name!r}"
    raise ScanError(f"scan_layers: {where} compared to layer 0; all layers need the same parameters and buffers.")


def layer_state(module, prefix, out):
    for name, p in _compat.nn.own_parameters(module).items():
        if p is not None:
            out[prefix + name] = p
    for name, b in _compat.nn.own_buffers(module).items():
        if b is not None:
            out[prefix + name] = b
    for name, sub in _compat.nn.child_modules(module).items():
        if sub is not None:
            layer_state(sub, prefix + name + ".", out)
    return out
