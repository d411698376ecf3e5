"""The linear-attention cache twin (``models.linear_cache``) against transformers' own
``LinearAttentionLayer``: the same reads, writes and returned values, out of place until the
twin's rows are taken back; and the layers it declines (those then run one by one). Eager and
tiny: the compiled decode step is ``test_scan_model.test_compiled_decode_step_is_one_scan``."""
import copy

import pytest
import torch

cu = pytest.importorskip("transformers.cache_utils")
if not hasattr(cu, "LinearAttentionLayer"):
    pytest.skip("transformers without linear-attention cache layers", allow_module_level=True)

from torch_scan_hop import ScanError  # noqa: E402
from torch_scan_hop.models.linear_cache import linear_twin  # noqa: E402
from torch_scan_hop.models.stacked_cache import stacked_slots  # noqa: E402

B, C, K = 2, 6, 4  # batch, conv channels, conv kernel


def _filled(number_of_states=1, record_past=False):
    """A layer after a 3-token prefill, as Qwen3-Next's gated delta net leaves it."""
    torch.manual_seed(0)
    layer = cu.LinearAttentionLayer(number_of_states=number_of_states)
    if record_past:
        layer.activate_past_recording()
    for i in range(number_of_states):
        layer.update_conv_state(torch.randn(B, C, 3), i, conv_kernel_size=K)
        layer.update_recurrent_state(torch.randn(B, 2, 3, 3), i)
    return layer


def _states(cache, reads, state_idx=None):
    """``(conv, recurrent, recording)`` as a layer reads them: through the ``Cache`` methods
    (``reads="methods"``, newer transformers 5) or the cache's layer itself (``"layer"``:
    ``cache.layers[i].conv_states[0]``, transformers 5.17's Qwen3-Next). The twin speaks both."""
    if reads == "methods":
        kw = {} if state_idx is None else dict(state_idx=state_idx)
        return cache.get_conv_state(0, **kw), cache.get_recurrent_state(0, **kw), cache.is_recording_past(0)
    layer = cache.layers[0]
    return layer.conv_states[0], layer.recurrent_states[0], layer.record_past


def _decode(cache, x, y, more, reads):
    """What the layer does with its cache: a one-token step (the conv state written in place by
    transformers' ``causal_conv1d_update``), a new recurrent state, then a 2-token step. (A state
    read before a write is not read after it: the twin's reads do not alias what it writes.)"""
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_update  # noqa: PLC0415

    conv, rec, _ = _states(cache, reads, state_idx=0)
    out = causal_conv1d_update(x, conv, torch.ones(C, K), None, "silu")
    cache.update_recurrent_state(rec * 0.5 + y, 0)
    assert not _states(cache, reads)[2]
    full = cache.update_conv_state(more, 0, conv_kernel_size=K)
    return out, full, cache.update_recurrent_state(_states(cache, reads)[1] + y, 0)


# the reference reads through the cache's layer, which every transformers with these layers offers
# (transformers 5.17's Cache has no get_conv_state); the twin is checked reading either way
@pytest.mark.parametrize("reads", ["methods", "layer"])
def test_the_twin_computes_what_the_layer_does_and_hands_it_back_in_place(reads):
    real, target = _filled(), _filled()
    before = [t.clone() for t in (target.conv_states[0], target.recurrent_states[0])]
    addresses = [t.data_ptr() for t in (target.conv_states[0], target.recurrent_states[0])]
    twin = linear_twin(target, 1)
    x, y, more = torch.randn(B, C, 1), torch.randn(B, 2, 3, 3), torch.randn(B, C, 2)
    want = _decode(cu.Cache(layers=[real]), x, y, more, "layer")
    got = _decode(twin, x, y, more, reads)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    torch.testing.assert_close([target.conv_states[0], target.recurrent_states[0]], before, rtol=0, atol=0)
    twin.take(twin.written())  # after the scan
    assert torch.equal(target.conv_states[0], real.conv_states[0])
    assert torch.equal(target.recurrent_states[0], real.recurrent_states[0])
    assert [t.data_ptr() for t in (target.conv_states[0], target.recurrent_states[0])] == addresses


def test_a_cache_of_linear_and_attention_layers_is_twinned_once_filled():
    cache = cu.DynamicCache()
    cache.layers = [_filled(), cu.DynamicLayer()]
    cache.layers[1].update(torch.randn(B, 2, 3, 8), torch.randn(B, 2, 3, 8))
    twins = stacked_slots(cache, [0, 1], 1)
    assert [type(t).__name__ for t in twins] == ["LinearRows", "DynamicRows"]
    cache.layers[0] = cu.LinearAttentionLayer()  # never filled: RecurrentGemma's (its states live on its modules)
    twins = stacked_slots(cache, [0, 1], 1)
    assert [type(t).__name__ for t in twins] == ["UnusedRows", "DynamicRows"]
    with pytest.raises(ScanError, match="layer 0 used its cache layer"):
        twins[0].update(torch.randn(B, 2, 1, 8), torch.randn(B, 2, 1, 8), 0)
    cache.layers[1] = cu.DynamicLayer()  # nothing filled (a prefill): the layers run one by one
    assert stacked_slots(cache, [0, 1], 1) is None


@pytest.mark.parametrize("layer", [
    pytest.param(lambda: cu.LinearAttentionLayer(), id="not filled"),
    pytest.param(lambda: _filled(record_past=True), id="recording its past"),
    pytest.param(lambda: _filled(number_of_states=2), id="two states"),
])
def test_layers_it_cannot_reproduce_run_one_by_one(layer):
    assert linear_twin(layer(), 1) is None
