"""Per-layer keyword inputs of ``scan_layers`` (``layer_kwargs``): what every layer shares,
what is one row per layer.

A model passes each layer keywords picked for it (Gemma 3: the sliding-window mask to sliding
layers, the full mask to the others; positions by layer type). In a scan, a keyword leaf that
is the same object for every layer is closed over (a constant of the body, as a broadcast
keyword is); a tensor leaf that differs is stacked into one ``(L, ...)`` input and sliced per
step, so each layer still gets its own; a plain value (an int, a flag) that differs cannot be
a scan input and is a ScanError naming the keyword and the layers, never a silent choice of
layer 0's.
"""
import torch

from .. import _compat
from ..core.trees import ScanError

_PLAIN = (bool, int, float, str, type(None))


class Varying:
    """The leaves that differ per layer: their positions in the flat keywords and their stacks'
    inputs (one list of tensors per position)."""

    def __init__(self, spec, template, positions, columns):
        self.spec, self.template, self.positions, self.columns = spec, template, positions, columns

    def stacks(self):
        """One ``(L, ...)`` tensor per varying leaf (a plain stack: gradients reach every row)."""
        return [torch.stack(column) for column in self.columns]

    def distinct(self):
        """Per varying leaf, ``(its distinct tensors stacked, each layer's index into them)``: a leaf
        taking a few values (Gemma 3's masks, one per kind) is stacked once, not once per layer."""
        out = []
        for column in self.columns:
            values = []
            for v in column:  # by identity (a plain loop: Dynamo traces `is`)
                if not any(v is u for u in values):
                    values.append(v)
            index = [next(i for i, v in enumerate(values) if v is t) for t in column]
            out.append((torch.stack(values), torch.tensor(index, device=column[0].device)))
        return out

    def rebuild(self, rows):
        """One layer's keywords from the shared leaves and its ``rows`` of the stacks."""
        leaves = list(self.template)
        for pos, row in zip(self.positions, rows):
            leaves[pos] = row
        return _compat.pytree.tree_unflatten(leaves, self.spec)


def split(per_layer, where):
    """``(shared, varying)``: the keywords every layer gets unchanged (a dict), and a ``Varying``
    (None when every leaf is shared). ``per_layer``: one dict per layer; ``where(i)`` names layer i."""
    flat = _flat_plain(per_layer) if _compat.is_dynamo_compiling() else None
    if flat is None:
        flat = [_compat.pytree.tree_flatten(kw) for kw in per_layer]
    spec = flat[0][1]
    for i, (_, s) in enumerate(flat[1:], 1):
        if s is not spec and s != spec:
            raise ScanError(f"scan_layers: {where(i)}'s keyword inputs have the structure {s}, {where(0)}'s "
                            f"{spec}; a scan needs one structure for every layer (pass None where a layer "
                            "has no value).")
    template, positions, columns = list(flat[0][0]), [], []
    for pos, leaf0 in enumerate(flat[0][0]):
        column = [leaves[pos] for leaves, _ in flat]
        if all(v is leaf0 for v in column):
            continue
        if all(isinstance(v, torch.Tensor) for v in column):
            _check_alike(column, spec, pos, where)
            positions.append(pos)
            columns.append(column)
            continue
        if type(leaf0) in _PLAIN and all(type(v) is type(leaf0) and v == leaf0 for v in column):
            continue
        i = next(i for i, v in enumerate(column) if v is not leaf0)
        raise ScanError(f"scan_layers: keyword input leaf {pos} ({_key(spec, pos)}) is {_show(column[i])} for "
                        f"{where(i)} but {_show(leaf0)} for {where(0)}; only tensors of one shape and dtype can "
                        "differ between scanned layers (they are stacked and sliced per layer).")
    if not positions:
        return _compat.pytree.tree_unflatten(template, spec), None
    return None, Varying(spec, template, positions, columns)


def _flat_plain(per_layer):
    """``tree_flatten`` of each layer's keywords where every one is a tree of dicts, lists and
    tuples: layer 0's by pytree, the others by a plain walk giving the same leaves in the same
    order and, where their structure is layer 0's, layer 0's spec itself (else their own, by
    pytree, for the message). Traced by Dynamo, pytree's walk of one layer's keywords cost
    ~80 ms (~1.3 s at 16 layers); the plain walk a fraction. None where a keyword is another
    container (a pytree node of its own): pytree then walks every layer."""
    leaves0, spec = _compat.pytree.tree_flatten(per_layer[0])
    shape0 = _plain_shape(per_layer[0])
    if shape0 is None:
        return None
    flat = [(leaves0, spec)]
    for kw in per_layer[1:]:
        leaves = []
        shape = _plain_shape(kw, leaves)
        if shape is None:
            return None
        flat.append((leaves, spec) if shape == shape0 else _compat.pytree.tree_flatten(kw))
    return flat


def _plain_shape(x, leaves=None):
    """The structure of a tree of dicts (in key order, as pytree), lists and tuples, its leaves
    appended to ``leaves``; None where a node is another container."""
    if type(x) is dict:
        parts = ["dict"]
        for key, v in x.items():
            sub = _plain_shape(v, leaves)
            if sub is None:
                return None
            parts.append((key, sub))
        return tuple(parts)
    if type(x) in (list, tuple):
        parts = [type(x).__name__]
        for v in x:
            sub = _plain_shape(v, leaves)
            if sub is None:
                return None
            parts.append(sub)
        return tuple(parts)
    if x is None or isinstance(x, torch.Tensor) or type(x) in _PLAIN:
        if leaves is not None:
            leaves.append(x)
        return "leaf"
    return None


def _check_alike(column, spec, pos, where):
    t0 = column[0]
    for i, t in enumerate(column[1:], 1):
        if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
            raise ScanError(f"scan_layers: keyword input {_key(spec, pos)} is {tuple(t.shape)}/{t.dtype} for "
                            f"{where(i)} but {tuple(t0.shape)}/{t0.dtype} for {where(0)}; a per-layer tensor "
                            "input is stacked over the layers, so every layer's needs one shape and dtype.")


def _key(spec, pos):
    """The keyword a flat leaf belongs to (its top-level key), for messages."""
    try:
        keys = spec.context
        sizes = [c.num_leaves for c in spec.children_specs]
    except AttributeError:
        return f"leaf {pos}"
    for key, size in zip(keys, sizes):
        if pos < size:
            return repr(key)
        pos -= size
    return f"leaf {pos}"


def _show(v):
    if isinstance(v, torch.Tensor):
        return f"a tensor {tuple(v.shape)}/{v.dtype}"
    return repr(v) if type(v) in _PLAIN else f"a {type(v).__name__}"
