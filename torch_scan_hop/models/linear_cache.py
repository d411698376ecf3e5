"""Linear-attention cache layers in a scanned decoder stack (Qwen3-Next's gated delta net).

transformers' ``LinearAttentionLayer`` holds, per layer, a convolution state ``(B, C, kernel)``
and a recurrent state (``(B, H, Dk, Dv)`` for a gated delta net). The layer reads them through
its cache (``get_conv_state`` / ``get_recurrent_state`` by ``layer_idx``) and writes them in
place: ``update_conv_state`` / ``update_recurrent_state`` ``copy_`` into the cache's tensors,
and a one-token decode step hands the conv state itself to ``causal_conv1d_update``, which
``copy_``s into it. In one scanned body neither works (the body is layer 0's code, and a
traced scan writes nothing in place), so ``LinearRows`` is the layer's twin, as
``models.stacked_cache``'s are for key/value layers: its two tensors are the layer's rows of
per-layer stacks, the reads return them, the writes make new tensors (what the real layer
would hold afterwards), and after the scan the real layer copies its rows back in place
(``take``): same tensors, same addresses, as ``generate()`` and CUDA graphs need.

Like the key/value twins, it assumes what a layer got from its cache is not read again after
the layer wrote that state through the cache: the real layer's reads alias its storage (so a
stale read would see the write), the twin's do not. Qwen3-Next reads each state, then writes it.

The twin speaks both ways transformers 5 layers read their cache: through the ``Cache``
methods above (``get_conv_state``, ``is_recording_past``; newer releases) and through the cache's
layer itself (``cache.layers[layer_idx].conv_states[0]``, ``.recurrent_states[0]``,
``.record_past``; transformers 5.17's Qwen3-Next), whichever the layer's code uses: ``layers``
hands out a view of the twin (``_LayerView``) whose reads are the methods'.

Only the state a decode step reads is twinned: a layer with one state (``number_of_states``
1), filled (``has_previous_state``) and not recording its past (``record_past``, whose conv
states grow for a later ``crop``). Anything else returns None and the layers run one by one.

RecurrentGemma's recurrent blocks keep their states on the modules themselves
(``RecurrentGemmaRecurrentBlock.conv1d_state``, ``RecurrentGemmaRglru.recurrent_states``), not in
the cache, whose layers for them stay empty: those get ``stacked_cache.UnusedRows``, and the
attributes are scanned as rows by ``layers.module_state``.
"""
import torch

from ..core.trees import ScanError
from ..layers.written_rows import WrittenRows


class LinearRows(WrittenRows):
    """``LinearAttentionLayer`` with one conv state and one recurrent state. ``kernel``: the conv
    state's length (equal in every layer twinned together, read from layer 0's in a scan step);
    ``tokens``: the step's length; ``target``: the real cache layer (None inside a scan step).
    The methods are the ``Cache`` methods the layer calls, by the layer's ``layer_idx``, which
    only selects the slot the rows already are (``selects``)."""

    selects = ("layer_idx",)

    def __init__(self, rows, tokens, target=None, kernel=None):
        self.conv, self.recurrent = rows
        self.tokens, self.target, self.kernel = tokens, target, kernel
        self.now = list(rows)  # the states as the layer has left them so far

    def rows(self):
        return (self.conv, self.recurrent)

    def python_state(self):
        return {"kernel": self.kernel}

    def over(self, rows):
        return type(self)(rows, self.tokens, kernel=self.kernel)

    def written(self):
        return tuple(self.now)

    def take(self, rows):
        self.target.conv_states[0].copy_(rows[0])
        self.target.recurrent_states[0].copy_(rows[1])

    @staticmethod
    def _one_state(state_idx):
        if state_idx != 0:
            raise ScanError(f"scan_model: a linear-attention layer asked its cache for state {state_idx}; the "
                            "scanned cache twins hold one conv and one recurrent state per layer.")

    def get_conv_state(self, layer_idx=None, state_idx=0):
        """A fresh tensor: a one-token decode step writes the returned state in place
        (``causal_conv1d_update``), and that write is what the layer leaves behind."""
        self._one_state(state_idx)
        self.now[0] = self.now[0].clone()
        return self.now[0]

    def get_recurrent_state(self, layer_idx=None, state_idx=0):
        self._one_state(state_idx)
        return self.now[1]

    def has_previous_state(self, layer_idx=None, state_idx=None):
        return True  # twinned only once filled

    def is_recording_past(self, layer_idx=None):
        return False  # twinned only when not recording

    def update_conv_state(self, conv_states, layer_idx=None, state_idx=0, **kwargs):
        """As ``LinearAttentionLayer.update_conv_state`` once filled: the full states (the kept
        ones, then the new) are returned, the last ``kernel`` are kept (cast as ``copy_`` casts)."""
        self._one_state(state_idx)
        full = torch.cat([self.now[0], conv_states], dim=-1)
        self.now[0] = full[..., -self.kernel:].to(self.conv.dtype)
        return full

    @property
    def layers(self):
        """``cache.layers[layer_idx]`` (older transformers' layers read their states there):
        this twin's view, whatever the index (the rows already are the layer's slot)."""
        return _AnyIndex(_LayerView(self))

    def update_recurrent_state(self, recurrent_states, layer_idx=None, state_idx=0, **kwargs):
        """As ``LinearAttentionLayer.update_recurrent_state``: the state kept (cast as ``copy_``
        casts), which it also returns."""
        self._one_state(state_idx)
        if recurrent_states.shape != self.recurrent.shape:
            raise ScanError(f"scan_model: a linear-attention layer wrote a recurrent state of shape "
                            f"{tuple(recurrent_states.shape)} into a cache holding {tuple(self.recurrent.shape)}; "
                            "the scanned cache twins keep the shape.")
        self.now[1] = recurrent_states.to(self.recurrent.dtype)
        return self.now[1]


class _AnyIndex:
    """``cache.layers`` of a twin: every index is the twin's own layer."""

    def __init__(self, view):
        self.view = view

    def __getitem__(self, index):
        return self.view


class _States:
    """A layer's ``conv_states`` / ``recurrent_states`` dict as the layer's code reads it
    (``[state_idx]``): the twin's read, so the reads agree with ``get_conv_state`` /
    ``get_recurrent_state`` (a conv state read this way is also written in place by
    ``causal_conv1d_update``: a fresh tensor, as there)."""

    def __init__(self, read):
        self.read = read

    def __getitem__(self, state_idx):
        return self.read(state_idx=state_idx)


class _LayerView:
    """The twin as a ``LinearAttentionLayer`` read directly: its states and ``record_past``."""

    record_past = False  # twinned only when not recording

    def __init__(self, twin):
        self.conv_states, self.recurrent_states = _States(twin.get_conv_state), _States(twin.get_recurrent_state)


def linear_twin(layer, tokens):
    """The twin of a filled ``LinearAttentionLayer`` (one state each, not recording its past), or
    None (the layers then run one by one)."""
    if getattr(layer, "number_of_states", None) != 1 or getattr(layer, "record_past", True):
        return None
    if not (layer.has_previous_state.get(0) and layer.is_conv_states_initialized.get(0)
            and layer.is_recurrent_states_initialized.get(0)):
        return None
    conv, recurrent, kernel = layer.conv_states[0], layer.recurrent_states[0], layer.conv_kernel_size[0]
    if not isinstance(kernel, int) or conv.shape[-1] != kernel:
        return None
    return LinearRows((conv, recurrent), tokens, layer, kernel=kernel)
