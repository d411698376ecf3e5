"""transformers' KV caches in a scanned decoder stack (``scan_model``'s decode step).

Each attention layer calls ``cache.update(keys, values, layer_idx)``, which writes that layer's
slot. In one scanned body every step is layer 0's code (its ``layer_idx``), and a traced scan
writes nothing in place, so a scanned step hands each layer a twin of its cache layer instead
(``layers.written_rows``): the slot's tensors as rows of per-layer stacks, updated out of place
exactly as the cache layer's own ``update`` updates them. After the scan each layer's cache takes
its rows back: copied into a static cache's tensors in place (same object, same addresses, as
``generate()`` and CUDA graphs need), assigned to a dynamic cache's attributes (which its own
``update`` replaces every step too). A compiled decode step then holds ONE scan whatever the depth.

Twins exist for the four layer classes of transformers' ``StaticCache`` and ``DynamicCache``:
``StaticLayer``, ``StaticSlidingWindowLayer``, ``DynamicLayer``, ``DynamicSlidingWindowLayer``,
and for their linear-attention layers (``LinearAttentionLayer``, Qwen3-Next's: ``models.linear_cache``).
A cache layer still empty when others are filled is one its model layer never calls
(RecurrentGemma's recurrent blocks keep their states on their modules: ``layers.module_state``;
their cache layers are ``LinearAttentionLayer``s, or in transformers 5.17 empty key/value layers).
A cache holding anything else (the hybrid linear-and-attention layer classes, an offloaded or
quantized cache, a subclass), no layer filled yet (the prefill), or layers whose Python-side
counters disagree, runs the layers one by one, as the model's own loop does.
"""
import collections

import torch

from ..core.trees import ScanError
from ..layers.written_rows import WrittenRows
from .linear_cache import linear_twin


class _Rows(WrittenRows):
    """What the twins share: the slot's ``keys``/``values`` rows, the layer index is a selector
    (the rows already are the slot), ``tokens`` (the step's query length, known before the scan:
    the Python counters of sliding layers advance by it) and ``target``, the real cache layer
    (None inside a scan step). ``state``: the names of the Python values (equal in every layer
    of one class, ``_alike_by_class``) its update reads; a scanned step reads layer 0's."""

    selects = ("layer_idx",)
    state = ()

    def __init__(self, rows, tokens, target=None, **state):
        self.keys, self.values = rows[0], rows[1]
        self.tokens, self.target, self.new = tokens, target, None
        for name in self.state:
            setattr(self, name, state[name])

    def rows(self):
        return (self.keys, self.values)

    def python_state(self):
        return {name: getattr(self, name) for name in self.state}

    def over(self, rows):
        return type(self)(rows, self.tokens, **self.python_state())

    def written(self):
        return self.rows() if self.new is None else self.new

    def _check_tokens(self, key_states):
        if key_states.shape[-2] != self.tokens:
            raise ScanError(f"scan_model: a layer wrote {key_states.shape[-2]} tokens into its cache where the "
                            f"step's hidden state has {self.tokens}; a scanned stack's cache twins assume one "
                            "key per token (self-attention).")


class UnusedRows(WrittenRows):
    """A cache layer still empty when the cache's other layers were filled (the prefill ran every
    layer with the cache): its model layer keeps its state elsewhere and never calls the cache
    (RecurrentGemma's recurrent blocks keep theirs on their modules, scanned as rows by
    ``layers.module_state``; their cache layers are linear-attention ones, or in transformers 5.17
    key/value ones left empty). No rows; a call to it is a ScanError naming the layer (never a
    wrong number)."""

    selects = ("layer_idx",)

    def __init__(self, index):
        self.index = index

    def rows(self):
        return ()

    def python_state(self):
        return {}

    def over(self, rows):
        return UnusedRows(self.index)

    def written(self):
        return ()

    def take(self, rows):
        pass

    def _used(self, *args, **kwargs):
        raise ScanError(f"scan_model: layer {self.index} used its cache layer, which was still empty after "
                        "the prefill filled the others; the scanned decode step took it for unused.")

    update = get_seq_length = get_mask_sizes = get_conv_state = get_recurrent_state = _used
    update_conv_state = update_recurrent_state = has_previous_state = is_recording_past = _used


class StaticRows(_Rows):
    """``StaticLayer``: keys/values ``(B, H, max_len, D)`` and the 0-d ``length`` so far."""

    def __init__(self, rows, tokens, target=None, **state):
        super().__init__(rows, tokens, target, **state)
        self.length = rows[2]

    def rows(self):
        return (self.keys, self.values, self.length)

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values, length = self.written()
        position = torch.arange(key_states.shape[-2], device=keys.device) + length
        keys = keys.index_copy(2, position, key_states)
        values = values.index_copy(2, position, value_states)
        self.new = (keys, values, length + key_states.shape[-2])
        return keys, values

    def take(self, rows):
        layer = self.target
        layer.keys.copy_(rows[0])
        layer.values.copy_(rows[1])
        layer.cumulative_length.copy_(rows[2])


class SlidingStaticRows(StaticRows):
    """``StaticSlidingWindowLayer``: a window of ``max_len`` rows; its Python count of tokens seen
    (``filled``, equal in every layer) picks the branch its ``update`` takes, as there."""

    state = ("filled",)

    def update(self, key_states, value_states, *args, **kwargs):
        self._check_tokens(key_states)
        keys, values, length = self.written()
        window, n = keys.shape[-2], key_states.shape[-2]
        if self.filled >= window:  # full: drop the oldest rows (a roll and an overwrite when n is 1)
            full_k, full_v = torch.cat((keys[:, :, 1:], key_states), -2), torch.cat((values[:, :, 1:], value_states), -2)
        elif self.filled + n > window:  # becoming full on this update
            full_k = key_states if self.filled == 0 else torch.cat((keys[:, :, :self.filled], key_states), -2)
            full_v = value_states if self.filled == 0 else torch.cat((values[:, :, :self.filled], value_states), -2)
        else:
            return super().update(key_states, value_states)
        self.new = (full_k[:, :, -window:], full_v[:, :, -window:], length)
        return full_k, full_v

    def take(self, rows):
        super().take(rows)
        self.target.cumulative_length_int += self.tokens


class DynamicRows(_Rows):
    """``DynamicLayer``: keys/values ``(B, H, seen, D)``, grown by concatenation."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = self.written()
        self.new = (torch.cat([keys, key_states], -2), torch.cat([values, value_states], -2))
        return self.new

    def take(self, rows):
        self.target.keys, self.target.values = rows


class SlidingDynamicRows(_Rows):
    """``DynamicSlidingWindowLayer`` (not recording the past): keeps the last ``window - 1`` rows
    and returns the full states; its Python ``cumulative_length`` advances by ``tokens``."""

    state = ("window",)

    def update(self, key_states, value_states, *args, **kwargs):
        self._check_tokens(key_states)
        keys, values = self.written()
        full_k, full_v = torch.cat([keys, key_states], -2), torch.cat([values, value_states], -2)
        self.new = (full_k[:, :, -self.window + 1:], full_v[:, :, -self.window + 1:])
        return full_k, full_v

    def take(self, rows):
        self.target.keys, self.target.values = rows
        self.target.cumulative_length += self.tokens


_Classes = collections.namedtuple(
    "_Classes", "StaticLayer StaticSlidingWindowLayer DynamicLayer DynamicSlidingWindowLayer LinearAttentionLayer")


def stacked_slots(cache, indices, tokens):
    """One twin per layer index of ``cache`` (``tokens``: the step's query length), or None when
    the cache is not one whose layers can be scanned as rows (see the module docstring)."""
    try:  # names imported from the module itself: Dynamo cannot trace transformers' lazy top-level module
        from transformers.cache_utils import (  # noqa: PLC0415
            DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticCache, StaticLayer, StaticSlidingWindowLayer)
    except ImportError:
        return None
    try:  # transformers 5's linear-attention layers (Qwen3-Next's); older versions: those caches run one by one
        from transformers.cache_utils import LinearAttentionLayer  # noqa: PLC0415
    except ImportError:
        LinearAttentionLayer = None  # noqa: N806
    cu = _Classes(StaticLayer, StaticSlidingWindowLayer, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer)
    if type(cache) not in (StaticCache, DynamicCache) or getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    if not isinstance(tokens, int) or layers is None or max(indices) >= len(layers):
        return None
    twins = [_twin(cu, layers[i], tokens, i) for i in indices]
    if any(t is None for t in twins) or all(type(t) is UnusedRows for t in twins) or not _alike_by_class(twins):
        return None
    return twins


def _twin(cu, layer, tokens, index):
    kind = type(layer)
    if kind is cu.LinearAttentionLayer:
        return UnusedRows(index) if _empty(layer) else linear_twin(layer, tokens)
    if kind not in (cu.StaticLayer, cu.StaticSlidingWindowLayer, cu.DynamicLayer, cu.DynamicSlidingWindowLayer):
        return None
    if not getattr(layer, "is_initialized", False) and layer.keys is None:
        return UnusedRows(index)  # empty: unused (see UnusedRows), or all are (a prefill: None in stacked_slots)
    if layer.keys is None or layer.keys.dim() != 4:
        return None
    rows = (layer.keys, layer.values)
    if kind is cu.StaticLayer:
        return StaticRows((*rows, layer.cumulative_length), tokens, layer)
    if kind is cu.StaticSlidingWindowLayer:
        return SlidingStaticRows((*rows, layer.cumulative_length), tokens, layer, filled=layer.cumulative_length_int)
    if kind is cu.DynamicLayer:
        return DynamicRows(rows, tokens, layer)
    if kind is cu.DynamicSlidingWindowLayer and not layer.record_past:
        return SlidingDynamicRows(rows, tokens, layer, window=layer.sliding_window)
    return None


def _empty(layer):
    """A linear-attention layer nothing was ever written to."""
    return not any((*layer.is_conv_states_initialized.values(), *layer.is_recurrent_states_initialized.values(),
                    *layer.has_previous_state.values()))


def _alike_by_class(twins):
    """Twins of one class hold rows of one shape, dtype and device and one Python state (they may
    be stacked together; the Python state is read from layer 0's twin in a scanned step)."""
    first = {}
    for twin in twins:
        ref = first.setdefault(type(twin), twin)
        if twin.python_state() != ref.python_state() or not all(
                a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                for a, b in zip(twin.rows(), ref.rows())):
            return False
    return True
