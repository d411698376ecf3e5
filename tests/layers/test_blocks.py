"""Runs of one kind inside a block, scanned as nested scans (``layers.blocks``).

A patterned stack (two "sliding" layers and a "full" one, repeated; per-layer scales that differ
in every layer) compiled after a first eager call, which reads the layers' kinds: the block's
two sliding layers run as a scan nested in the block's step. Values and every gradient against
the Python loop in float64, the nesting itself in the graph, writes to module attributes inside
a nested run handed back to each layer, and where the block stays flat.
"""
import pytest
import torch

from torch_scan_hop import scan_layers
from torch_scan_hop.layers import blocks

D = 6


class Kind(torch.nn.Module):
    def __init__(self, kind, index, keeps_state=False):
        super().__init__()
        # the full layers' Linear has no bias: kinds with one weight signature would run as one
        # scan choosing the code by kind (layers.alike), not as blocks
        self.lin = torch.nn.Linear(D, D, bias=kind == "sliding", dtype=torch.float64)
        self.kind, self.layer_idx, self.keeps_state = kind, index, keeps_state
        self.state = None

    def forward(self, h, mask=None, scale=None):
        z = self.lin(h)
        z = torch.tanh(z) * mask if self.kind == "sliding" else torch.sin(z) + mask
        if self.keeps_state:  # RecurrentGemma keeps per-call state on its modules
            self.state = z * 2
        return h + z * scale


PATTERN = ["sliding", "sliding", "full"]


def _stack(n_blocks=2, extra=(), **kw):
    torch.manual_seed(0)
    kinds = PATTERN * n_blocks + list(extra)
    return torch.nn.ModuleList([Kind(k, i, **kw) for i, k in enumerate(kinds)])


def _inputs(layers):
    masks = {"sliding": torch.rand(D, dtype=torch.float64), "full": torch.rand(D, dtype=torch.float64)}
    scales = torch.rand(len(layers), D, dtype=torch.float64, requires_grad=True)
    per_layer = [dict(mask=masks[layer.kind], scale=scales[i]) for i, layer in enumerate(layers)]
    return torch.randn(2, D, dtype=torch.float64, requires_grad=True), scales, per_layer


def _loop(layers, h, per_layer):
    for layer, kw in zip(layers, per_layer):
        h = layer(h, **kw)
    return h


def _value_and_grads(fn, layers, h, scales):
    out = fn()
    return out, torch.autograd.grad(out.square().sum(), [h, scales, *layers.parameters()])


def _aot_eager_recording():
    """aot_eager that keeps the forward graphs it compiles."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []
    return graphs, aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm.forward,
                                bw_compiler=lambda gm, _: gm.forward)


def _scan_depths(gm, depth=0):
    """The nesting depth of every scan node in ``gm`` and the graphs it calls."""
    found = [depth for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]
    for sub in gm.children():
        if isinstance(sub, torch.fx.GraphModule):
            found += _scan_depths(sub, depth + 1)
    return found


@pytest.mark.parametrize("remat", ["save_all", "recompute_all"])
def test_nested_runs_match_the_loop(remat, fresh_dynamo):
    layers = _stack(extra=["sliding"])  # 2 blocks of 3 and a layer left over
    h, scales, per_layer = _inputs(layers)
    want = _value_and_grads(lambda: _loop(layers, h, per_layer), layers, h, scales)
    scan_layers(layers, h, layer_kwargs=per_layer, period="auto", remat=remat)  # eager: reads the kinds
    graphs, backend = _aot_eager_recording()
    compiled = torch.compile(lambda: scan_layers(layers, h, layer_kwargs=per_layer, period="auto", remat=remat),
                             backend=backend, fullgraph=True)
    got = _value_and_grads(compiled, layers, h, scales)
    torch.testing.assert_close(got, want)
    depths = sorted(d for gm in graphs for d in _scan_depths(gm))
    assert depths == [0, 1], depths  # the scan over blocks, and the sliding run nested in its step


def test_attributes_written_in_a_nested_run_reach_each_layer(fresh_dynamo):
    layers = _stack(keeps_state=True)
    h, scales, per_layer = _inputs(layers)
    want = _loop(layers, h, per_layer)
    states = [layer.state.detach().clone() for layer in layers]
    scan_layers(layers, h, layer_kwargs=per_layer, period="auto")  # eager: reads the kinds
    for layer in layers:
        layer.state = None
    got = torch.compile(lambda: scan_layers(layers, h, layer_kwargs=per_layer, period="auto"),
                        backend="aot_eager", fullgraph=True)()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close([layer.state for layer in layers], states)  # each layer its own row


def test_blocks_made_under_dynamo_stay_flat_until_an_eager_call(fresh_dynamo):
    """Under Dynamo only the weights' kinds are known (the sliding and full layers look alike):
    the block is flat, and not cached, so a later eager call makes the blocks with their runs."""
    layers = _stack()
    h, scales, per_layer = _inputs(layers)
    want = _loop(layers, h, per_layer)
    graphs, backend = _aot_eager_recording()
    got = torch.compile(lambda: scan_layers(layers, h, layer_kwargs=per_layer, period=3),
                        backend=backend, fullgraph=True)()
    torch.testing.assert_close(got, want)
    assert [d for gm in graphs for d in _scan_depths(gm)] == [0]
    scan_layers(layers, h, layer_kwargs=per_layer, period=3)
    made = blocks.blocks_of(layers, list(layers), next(iter(layers._scan_layers_plans.values()))[1][0])
    assert made[0].scan_runs == ((0, 2), (2, 1))


def test_runs_of():
    assert blocks.runs_of((0, 0, 0, 0, 0, 1)) == ((0, 5), (5, 1))
    assert blocks.runs_of((0, 1, 1, 0)) == ((0, 1), (1, 2), (3, 1))
    assert blocks.runs_of(()) == ()
