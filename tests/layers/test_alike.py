"""Layers of several kinds with one weight signature, run as ONE scan choosing each layer's code
by kind (``layers.alike``), and the cond whose branches trace alike inlined (``trace.same_branches``).

Two stacks of one pattern (two "sliding" layers and a "full" one, repeated, plus one left over):
in one the kind selects code (tanh or sin: the cond stays, each layer runs its own kind's code),
in the other the kind is only handed to a function that ignores it (Gemma 3's ``sliding_window``
under sdpa: the cond is inlined, the body is one layer). Values and every gradient against the
Python loop in float64, compiled (aot_eager); the kinds are read outside the trace first, as
``scan_model`` and a first eager call do.
"""
import pytest
import torch

from torch_scan_hop import scan_layers
from torch_scan_hop.layers import alike, one_code, patterns
from torch_scan_hop.trace import same_branches

D = 5


def _ignores(h, window=None):
    return h


class Layer(torch.nn.Module):
    def __init__(self, kind, selects):
        super().__init__()
        self.lin = torch.nn.Linear(D, D, dtype=torch.float64)
        self.kind, self.selects = kind, selects
        self.window = 3 if kind == "sliding" else None

    def forward(self, h, mask=None, scale=1.0):
        z = _ignores(self.lin(h), window=self.window)
        if self.selects:
            z = torch.tanh(z) if self.kind == "sliding" else torch.sin(z)
        else:
            z = torch.tanh(z)
        return h + z * mask * scale


def _stack(selects):
    torch.manual_seed(0)
    kinds = ["sliding", "sliding", "full"] * 2 + ["sliding"]
    return torch.nn.ModuleList([Layer(k, selects) for k in kinds])


def _run(layers, h, per_layer):
    return scan_layers(layers, h, layer_kwargs=per_layer, period="auto")


def _loop(layers, h, per_layer):
    for layer, kw in zip(layers, per_layer):
        h = layer(h, **kw)
    return h


def _nodes(gm, target):
    found = [n for n in gm.graph.nodes if n.target is target]
    return found + [n for sub in gm.children() if isinstance(sub, torch.fx.GraphModule) for n in _nodes(sub, target)]


def _scans(gm):
    return _nodes(gm, torch.ops.higher_order.scan)


@pytest.mark.parametrize("selects", [False, True])
def test_one_scan_over_kinds_matches_the_loop(selects, fresh_dynamo):
    from torch._dynamo.backends.common import aot_autograd

    layers = _stack(selects)
    masks = {"sliding": torch.rand(D, dtype=torch.float64), "full": torch.rand(D, dtype=torch.float64)}
    scales = torch.rand(len(layers), dtype=torch.float64, requires_grad=True)
    per_layer = [dict(mask=masks[layer.kind], scale=scales[i]) for i, layer in enumerate(layers)]  # 2 masks, 7 scales
    h = torch.randn(2, D, dtype=torch.float64, requires_grad=True)
    params = [h, scales, *layers.parameters()]
    want = _loop(layers, h, per_layer)
    want_grads = torch.autograd.grad(want.square().sum(), params)
    assert patterns.stack_alike(layers, list(layers)) == (0, 0, 1, 0, 0, 1, 0)  # read outside the trace
    graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm.forward,
                           bw_compiler=lambda gm, _: gm.forward)
    before = {**same_branches.counts(), **one_code.counts()}
    got = torch.compile(lambda: _run(layers, h, per_layer), backend=backend, fullgraph=True)()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.square().sum(), params), want_grads)
    after = {**same_branches.counts(), **one_code.counts()}
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("inlined", "kept", "alike", "differ")}
    # told at trace time (layers.trace_time): alike kinds run one layer's code, no cond to inline
    assert grew == ({"inlined": 0, "kept": grew["kept"], "alike": 0, "differ": grew["differ"]} if selects else
                    {"inlined": 0, "kept": 0, "alike": grew["alike"], "differ": 0}), grew
    assert (grew["kept"] > 0 and grew["differ"] > 0) if selects else grew["alike"] > 0, grew
    assert bool([n for gm in graphs for n in _nodes(gm, torch.ops.higher_order.cond)]) == selects
    assert len([n for gm in graphs for n in _scans(gm)]) == 1  # one scan over all seven layers, not nested


def test_layers_with_different_weights_are_not_alike():
    layers = _stack(True)
    layers[2].lin = torch.nn.Linear(D, D, bias=False, dtype=torch.float64)
    assert patterns.stack_alike(layers, list(layers)) is None


def test_eager_is_the_loop():
    layers = _stack(True)
    per_layer = [dict(mask=torch.ones(D, dtype=torch.float64)) for _ in layers]
    h = torch.randn(2, D, dtype=torch.float64)
    assert alike.scan_alike(list(layers), (0, 0, 1, 0, 0, 1, 0), h, per_layer, "save_all", None) is None
    torch.testing.assert_close(_run(layers, h, per_layer), _loop(layers, h, per_layer))
