"""transformers' static KV cache in a scanned decoder stack (``scan_model``'s decode step).

Each attention layer calls ``cache.update(keys, values, layer_idx)``, which writes that layer's
slot in place. In one scanned body every step is layer 0's code (its ``layer_idx``), and a traced
scan writes nothing in place, so a scanned step hands each layer a ``StaticRows`` instead: the
layer's cached keys, values and length as rows of per-layer stacks (``layers.written_rows``),
updated out of place as ``StaticLayer.update`` updates them. After the scan each layer's rows
are copied back into its cache tensors, in place: the cache object, its tensors' addresses and
``generate()``'s view of it are as the layers one by one leave them, and a compiled decode step
holds ONE scan whatever the depth.

Only caches whose layers are all transformers' plain ``StaticLayer`` (``StaticCache`` with full
attention), filled (after the prefill) and alike, are stacked; any other cache (dynamic,
sliding-window, linear-attention) runs the layers one by one, as the model's own loop does.
"""
import torch

from ..layers.written_rows import WrittenRows


class StaticRows(WrittenRows):
    """One layer's static cache slot as rows: ``keys``/``values`` ``(B, H, max_len, D)`` and the
    0-d ``length`` (tokens cached so far). ``update`` is ``StaticLayer.update``'s out-of-place
    twin; ``take`` copies rows back into the cache layer ``target`` (None inside a scan step).
    The attention's ``layer_idx`` only picks the slot, which the rows already are."""

    selects = ("layer_idx",)

    def __init__(self, keys, values, length, target=None):
        self.keys, self.values, self.length, self.target = keys, values, length, target
        self.new = None

    def rows(self):
        return (self.keys, self.values, self.length)

    def over(self, rows):
        return StaticRows(*rows)

    def written(self):
        return self.rows() if self.new is None else self.new

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values, length = self.written()
        position = torch.arange(key_states.shape[-2], device=keys.device) + length
        keys = keys.index_copy(2, position, key_states)
        values = values.index_copy(2, position, value_states)
        self.new = (keys, values, length + key_states.shape[-2])
        return keys, values

    def take(self, rows):
        keys, values, length = rows
        layer = self.target
        layer.keys.copy_(keys)
        layer.values.copy_(values)
        layer.cumulative_length.copy_(length)


def stacked_slots(cache, indices):
    """One ``StaticRows`` per layer index of ``cache`` (a transformers ``StaticCache`` of filled
    plain ``StaticLayer`` s alike), or None when the cache is not such a one."""
    try:
        from transformers.cache_utils import StaticCache, StaticLayer  # noqa: PLC0415
    except ImportError:
        return None
    if type(cache) is not StaticCache:
        return None
    layers = getattr(cache, "layers", None)
    if layers is None or max(indices) >= len(layers):
        return None
    chosen = [layers[i] for i in indices]
    if not all(type(layer) is StaticLayer and getattr(layer, "is_initialized", False) for layer in chosen):
        return None
    first = chosen[0]
    if not all(_alike(layer.keys, first.keys) and _alike(layer.values, first.values) for layer in chosen):
        return None
    return [StaticRows(layer.keys, layer.values, layer.cumulative_length, target=layer) for layer in chosen]


def _alike(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
