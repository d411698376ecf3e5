"""scan_layers over patterned stacks (``period``) and with per-layer keyword inputs (``layer_kwargs``).

A stack of two kinds of layer (a sliding and a full "attention", told apart by a plain attribute
and given different masks, as Gemma 3's are) and a per-layer index nobody reads: values and
gradients (of the weights, the input and the per-layer tensors) against the Python loop, eager
and compiled, in float64; the plans ``layers.patterns`` makes; the refusals.
"""
import pytest
import torch
from conftest import capture_graphs

from torch_scan_hop import ScanError, scan_layers
from torch_scan_hop.layers import patterns
from torch_scan_hop.layers.patterns import stack_plan

D = 6


class Kind(torch.nn.Module):
    def __init__(self, kind, index, reads_index=False, alike_weights=False):
        super().__init__()
        # the full layers' Linear has no bias: kinds with one weight signature would run as one
        # scan choosing the code by kind (layers.alike, tests/layers/test_alike.py), not as blocks
        self.lin = torch.nn.Linear(D, D, bias=alike_weights or kind == "sliding", dtype=torch.float64)
        self.kind, self.layer_idx, self.reads_index = kind, index, reads_index

    def forward(self, h, mask=None, scale=None):
        z = self.lin(h)
        if self.reads_index:
            z = z + self.layer_idx
        if self.kind == "sliding":
            z = torch.tanh(z) * mask
        else:
            z = torch.sin(z) + mask
        return h + (z if scale is None else z * scale)


def _stack(kinds, **kw):
    torch.manual_seed(0)
    return torch.nn.ModuleList([Kind(k, i, **kw) for i, k in enumerate(kinds)])


GEMMA_LIKE = ["sliding"] * 2 + ["full"]  # period 3


def _kwargs(layers, masks, scales=None):
    return [dict(mask=masks[layer.kind], **({} if scales is None else {"scale": scales[i]}))
            for i, layer in enumerate(layers)]


def _loop(layers, h, per_layer):
    for layer, kw in zip(layers, per_layer):
        h = layer(h, **kw)
    return h


def _value_and_grads(fn, layers, h, leaves):
    out = fn()
    grads = torch.autograd.grad(out.square().sum(), [h, *layers.parameters(), *leaves])
    return out, grads


@pytest.mark.parametrize("depth, plan", [
    (7, [patterns.Segment(0, 3, 2), patterns.Segment(6, 1, 1)]),
    (8, [patterns.Segment(0, 3, 2), patterns.Segment(6, 1, 2)]),
    (3, [patterns.Segment(0, 1, 2), patterns.Segment(2, 1, 1)]),
])
def test_plans(depth, plan):
    layers = _stack((GEMMA_LIKE * 3)[:depth])
    assert list(stack_plan(layers, list(layers), "auto")) == plan


def test_a_different_number_per_layer_is_data_not_kind():
    layers = _stack(["full"] * 4)
    assert patterns.kinds(layers) == (0, 0, 0, 0)  # layer_idx differs everywhere: not a kind
    assert patterns.kinds(_stack(GEMMA_LIKE * 2)) == (0, 0, 1, 0, 0, 1)


@pytest.mark.parametrize("backend, period", [(None, "auto"), (None, 3), ("aot_eager", "auto"), ("aot_eager", 3),
                                             ("inductor", "auto")])
def test_patterned_stack_matches_the_loop(backend, period, fresh_dynamo):
    layers = _stack(GEMMA_LIKE * 2 + ["sliding"])
    h = torch.randn(2, D, dtype=torch.float64, requires_grad=True)
    masks = {"sliding": torch.rand(D, dtype=torch.float64, requires_grad=True),
             "full": torch.rand(D, dtype=torch.float64, requires_grad=True)}
    per_layer = _kwargs(layers, masks)
    want = _value_and_grads(lambda: _loop(layers, h, per_layer), layers, h, masks.values())

    def run():
        return scan_layers(layers, h, layer_kwargs=per_layer, period=period)

    run()  # the pattern is read from the layers' attributes outside the trace (scan_model does it when called)
    f = run if backend is None else torch.compile(run, backend=backend, fullgraph=True)
    got = _value_and_grads(f, layers, h, masks.values())
    torch.testing.assert_close(got, want)


def test_compiled_first_a_pattern_of_attributes_alone_is_read_at_trace_time(fresh_dynamo):
    """Dynamo cannot list a module's attributes; compiled before any eager call (nothing cached
    on the stack), the kinds are read in Python at trace time (``layers.trace_time``): layers that
    differ only in a plain attribute (here one that selects tanh or sin) run their own kind's code,
    as in the loop (before, they were taken for one kind and the body's read was refused)."""
    layers = _stack(GEMMA_LIKE * 2, alike_weights=True)
    h = torch.randn(2, D, dtype=torch.float64, requires_grad=True)
    masks = {"sliding": torch.rand(D, dtype=torch.float64), "full": torch.rand(D, dtype=torch.float64)}
    per_layer = _kwargs(layers, masks)
    want = _value_and_grads(lambda: _loop(layers, h, per_layer), layers, h, [])
    assert getattr(layers, "_scan_layers_alike", None) is None and getattr(layers, "_scan_layers_plans", None) is None
    f = torch.compile(lambda: scan_layers(layers, h, layer_kwargs=per_layer, period="auto"),
                      backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(_value_and_grads(f, layers, h, []), want)


def test_one_scan_over_blocks_in_the_graph(fresh_dynamo):
    layers = _stack(GEMMA_LIKE * 3)
    h = torch.randn(2, D, dtype=torch.float64)
    masks = {"sliding": torch.rand(D, dtype=torch.float64), "full": torch.rand(D, dtype=torch.float64)}
    graphs, backend = capture_graphs()
    scan_layers(layers, h, layer_kwargs=_kwargs(layers, masks), period="auto")
    torch.compile(lambda: scan_layers(layers, h, layer_kwargs=_kwargs(layers, masks), period="auto"),
                  backend=backend, fullgraph=True)()
    assert sum(n.target is torch.ops.higher_order.scan for gm in graphs for n in gm.graph.nodes) == 1


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_per_layer_tensors_are_stacked_and_get_gradients(backend, fresh_dynamo):
    layers = _stack(["full"] * 4)
    h = torch.randn(2, D, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(D, dtype=torch.float64)
    scales = [torch.rand((), dtype=torch.float64, requires_grad=True) for _ in layers]
    per_layer = _kwargs(layers, {"full": mask}, scales)
    want = _value_and_grads(lambda: _loop(layers, h, per_layer), layers, h, scales)

    def run():
        return scan_layers(layers, h, layer_kwargs=per_layer)

    f = run if backend is None else torch.compile(run, backend=backend, fullgraph=True)
    torch.testing.assert_close(_value_and_grads(f, layers, h, scales), want)


def test_a_plain_value_differing_per_layer_is_refused_when_traced(fresh_dynamo):
    layers = _stack(["full"] * 3)
    h = torch.randn(2, D, dtype=torch.float64)
    per_layer = [dict(mask=torch.ones(D, dtype=torch.float64), scale=float(i)) for i in range(3)]
    torch.testing.assert_close(scan_layers(layers, h, layer_kwargs=per_layer), _loop(layers, h, per_layer))
    with pytest.raises(Exception, match=r"keyword input leaf 1 \('scale'\) is 1.0 for layer 1 \(Kind\) but 0.0"):
        torch.compile(lambda: scan_layers(layers, h, layer_kwargs=per_layer), backend="aot_eager", fullgraph=True)()


def test_a_body_reading_per_layer_data_is_refused(fresh_dynamo):
    layers = _stack(GEMMA_LIKE * 2, reads_index=True)
    h = torch.randn(2, D, dtype=torch.float64)
    masks = {"sliding": torch.ones(D, dtype=torch.float64), "full": torch.ones(D, dtype=torch.float64)}
    scan_layers(layers, h, layer_kwargs=_kwargs(layers, masks), period="auto")
    with pytest.raises(Exception, match=r"layer 1's attribute 'layer_idx' is 1 but layer 0's is 0"):
        torch.compile(lambda: scan_layers(layers, h, layer_kwargs=_kwargs(layers, masks), period="auto"),
                      backend="aot_eager", fullgraph=True)()


@pytest.mark.parametrize("bad, message", [
    ([{}], r"layer_kwargs must be one dict of keyword inputs per layer \(3 layers\)"),
    ([{"mask": 1}] * 3, r"keyword 'mask' is given both for every layer and in layer_kwargs\[0\]"),
])
def test_bad_layer_kwargs(bad, message):
    layers = _stack(["full"] * 3)
    with pytest.raises(ScanError, match=message):
        scan_layers(layers, torch.randn(2, D, dtype=torch.float64), layer_kwargs=bad, mask=torch.ones(D))


def test_bad_period():
    layers = _stack(["full"] * 3)
    with pytest.raises(ScanError, match="period must be a positive int or 'auto', got 0"):
        scan_layers(layers, torch.randn(2, D, dtype=torch.float64), period=0, mask=torch.ones(D))


class Writes(torch.nn.Module):
    """A layer keeping per-call state in a plain attribute (RecurrentGemma's recurrent_states)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D, dtype=torch.float64)
        self.state = None

    def forward(self, h):
        self.state = torch.tanh(self.lin(h))
        return h + self.state * 2


def test_attributes_the_body_writes_are_read_back_within_the_step(fresh_dynamo):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Writes() for _ in range(3)])
    h = torch.randn(2, D, dtype=torch.float64)
    want = _loop(layers, h, [{}] * 3)
    states = [layer.state for layer in layers]
    for layer in layers:
        layer.state = None
    got = torch.compile(lambda: scan_layers(layers, h), backend="aot_eager", fullgraph=True)()
    torch.testing.assert_close(got, want)
    # handed back to each layer after the scan, as the loop leaves them (layers.module_state)
    torch.testing.assert_close([layer.state for layer in layers], states)


def test_a_replaced_layer_is_planned_and_blocked_again(fresh_dynamo):
    """The plan and the blocks are cached on the container: replacing a layer must not leave a
    block running the old one."""
    layers = _stack(GEMMA_LIKE * 2)
    h = torch.randn(2, D, dtype=torch.float64)
    masks = {"sliding": torch.rand(D, dtype=torch.float64), "full": torch.rand(D, dtype=torch.float64)}
    scan_layers(layers, h, layer_kwargs=_kwargs(layers, masks), period="auto")
    torch.manual_seed(1)
    layers[4] = Kind("sliding", 4)
    per_layer = _kwargs(layers, masks)
    want = _loop(layers, h, per_layer)
    torch.testing.assert_close(scan_layers(layers, h, layer_kwargs=per_layer, period="auto"), want)
    got = torch.compile(lambda: scan_layers(layers, h, layer_kwargs=per_layer, period="auto"),
                        backend="aot_eager", fullgraph=True)()
    torch.testing.assert_close(got, want)
