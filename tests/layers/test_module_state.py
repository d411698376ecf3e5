"""scan_layers with state kept on the layers' modules (``layers.module_state``): a toy running
state per layer, a plain tensor attribute its forward reads and reassigns (as RecurrentGemma's
recurrent blocks do), against the Python loop, eager and compiled."""
import copy

import pytest
import torch

from torch_scan_hop import ScanError, scan_layers
from torch_scan_hop.layers import module_state


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.state = None  # None until the first call, then (B, D)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.inner = torch.nn.Linear(4, 4), Inner()
        self.cleared = None  # assigned None by every call

    def forward(self, h):
        self.cleared = None
        self.inner.state = (0 if self.inner.state is None else self.inner.state * 0.5) + self.lin(h)
        return torch.tanh(self.inner.state)


def _stacks():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer() for _ in range(3))
    for layer in layers:
        layer.inner.state = torch.randn(2, 4)
        layer.cleared = torch.ones(1)
    module_state.record(layers[0])  # what scan_model does when it prepares a model
    return layers, copy.deepcopy(layers)


def _loop(layers, h):
    for layer in layers:
        h = layer(h)
    return h


def test_compiled_scan_reads_each_layers_state_and_hands_back_its_writes(fresh_dynamo):
    layers, ref = _stacks()
    h = torch.randn(2, 4)
    for _ in range(2):  # the second call reads the states the first one handed back
        with torch.no_grad():  # as generate() runs; states requiring grad are not rows (module_state.rows)
            want = _loop(ref, h)
            got = torch.compile(lambda h: scan_layers(layers, h), backend="eager", fullgraph=True)(h)
        torch.testing.assert_close(got, want)
        for g, w in zip(layers, ref):
            torch.testing.assert_close(g.inner.state, w.inner.state)
            assert g.cleared is None and w.cleared is None


def test_rows_are_the_differing_plain_tensors_only():
    layers, _ = _stacks()
    shared = torch.zeros(1)
    for layer in layers:
        layer.inner.shared = shared  # one object in every layer: read as it is
    rows = module_state.rows(layers[0], list(layers))
    assert list(rows) == ["cleared", "inner.state"]
    assert rows["inner.state"].shape == (3, 2, 4)


def test_states_requiring_grad_are_not_rows_and_a_difference_is_refused(fresh_dynamo):
    """Under grad mode a state the previous call left with its graph is not stacked (the scan's
    backward would reach that graph, read or not): read as layer 0's, refused as it differs."""
    layers, _ = _stacks()
    h = torch.randn(2, 4)
    compiled = torch.compile(lambda h: scan_layers(layers, h), backend="eager", fullgraph=True)
    compiled(h)  # hands back states computed from the weights: they require grad
    assert all(layer.inner.state.requires_grad for layer in layers)
    with pytest.raises(ScanError, match="inner.state"):
        compiled(h)


class ScaledLayer(torch.nn.Module):
    """A per-layer tensor its forward only reads (never assigns)."""

    def __init__(self, scale):
        super().__init__()
        self.lin, self.scale = torch.nn.Linear(4, 4), torch.full((4,), scale)

    def forward(self, h):
        return torch.tanh(self.lin(h) * self.scale)


def test_a_state_the_body_only_reads_is_each_layers_own_and_left_as_it_is(fresh_dynamo):
    """Read as rows (each layer its own value), and not handed back: each layer keeps its tensor
    object, as the loop leaves it."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(ScaledLayer(s) for s in (0.5, 1.0, 2.0))
    module_state.record(layers[0])
    scales = [layer.scale for layer in layers]
    h = torch.randn(2, 4)
    with torch.no_grad():
        got = torch.compile(lambda h: scan_layers(layers, h), backend="eager", fullgraph=True)(h)
        torch.testing.assert_close(got, _loop(layers, h))
    assert all(layer.scale is s for layer, s in zip(layers, scales))
