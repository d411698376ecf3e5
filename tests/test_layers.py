"""scan_layers: a stack of identical modules as one scan; grads on each layer's own parameters."""
import copy

import pytest
import torch
from conftest import assert_trees_close
from decoder import DecoderBlock, causal_mask, make_stack, run_loop

import torch_scan_hop
from torch_scan_hop import ScanError, scan_layers

try:
    import torch_xla
except ImportError:
    torch_xla = None


def grads(layers):
    return [p.grad.clone() for p in layers.parameters()]


def train_step(fn, layers, x, mask):
    layers.zero_grad()
    out = fn(layers, x, attn_mask=mask)
    (out.pow(2).mean()).backward()
    return out.detach(), grads(layers)


@pytest.mark.parametrize("remat", ["save_all", "recompute_all"])
def test_decoder_stack_matches_for_loop_forward_and_backward(remat):
    layers = make_stack(8)
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    want = train_step(run_loop, layers, x, mask)
    got = train_step(lambda l, x, **kw: scan_layers(l, x, remat=remat, **kw), layers, x, mask)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-4)


def test_float64_gradcheck_through_scan_layers_and_input():
    torch.manual_seed(1)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()) for _ in range(3))
    layers = layers.double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    params = list(layers.parameters())

    def f(x, *ps):
        with torch.nn.utils.stateless._reparametrize_module(layers, dict(zip(
                [n for n, _ in layers.named_parameters()], ps))):
            return scan_layers(layers, x)

    assert torch.autograd.gradcheck(f, (x, *params))


def test_multiple_inputs_and_static_kwargs():
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, a, b, scale=1.0):
            return torch.tanh(self.lin(a) * scale + b), b * 0.5

    torch.manual_seed(2)
    layers = torch.nn.ModuleList(Pair() for _ in range(4))
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    want = (a, b)
    for layer in layers:
        want = layer(*want, scale=2.0)
    got = scan_layers(layers, a, b, scale=2.0)
    assert isinstance(got, tuple)
    assert_trees_close(got, want, atol=1e-6, rtol=1e-5)


def test_structure_mismatch_names_layer_and_parameter():
    layers = make_stack(3)
    layers[2].fc1 = torch.nn.Linear(32, 64)
    with pytest.raises(ScanError, match=r"layer 2's 'fc1.weight' is \(64, 32\)/torch.float32 but layer 0's is "
                                        r"\(128, 32\)"):
        scan_layers(layers, torch.randn(1, 2, 32))
    layers[2] = torch.nn.Linear(32, 32)
    with pytest.raises(ScanError, match="layer 2 is a Linear, layer 0 a DecoderBlock"):
        scan_layers(layers, torch.randn(1, 2, 32))
    with pytest.raises(ScanError, match="layers is empty"):
        scan_layers([], torch.randn(1))


def test_new_mask_each_call_does_not_retrace():
    layers = make_stack(4)
    calls = [0]
    real_forward = DecoderBlock.forward

    def counting(self, *a, **k):
        calls[0] += 1
        return real_forward(self, *a, **k)

    torch_scan_hop.clear_cache()
    DecoderBlock.forward = counting
    try:
        for i in range(3):
            calls[0] = 0
            x = torch.randn(2, 5, 32)
            out = scan_layers(layers, x, attn_mask=causal_mask(5))  # a new mask tensor every call
            out.sum().backward()
            assert calls[0] == (1 if i == 0 else 0)  # one trace on the first call, then none
    finally:
        DecoderBlock.forward = real_forward


def test_torch_compile_matches_loop_and_is_one_scan():
    layers = make_stack(8)
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    want = train_step(run_loop, layers, x, mask)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda l, x, **kw: scan_layers(l, x, **kw), backend=backend, fullgraph=True)
    got = train_step(compiled, layers, x, mask)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-4)
    nodes = graphs[0].graph.nodes
    assert sum(n.target is torch.ops.higher_order.scan for n in nodes) == 1
    # stacked by an op inductor calls rather than generates code for (compile time grew with depth)
    stacks = [n for n in nodes if n.target is torch.ops.torch_scan_hop.stack_layers.default]
    assert len(stacks) == len(list(_state_names(layers)))


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_has_one_scan_over_stacked_weights(strict):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = make_stack(4)

        def forward(self, x, mask):
            return scan_layers(self.layers, x, attn_mask=mask)

    model = Model()
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    ep = torch.export.export(model, (x, mask), strict=strict)
    nodes = list(ep.graph.nodes)
    assert sum(n.target is torch.ops.higher_order.scan for n in nodes) == 1
    # plain aten.stack: the exported program needs none of our ops
    assert sum(n.target is torch.ops.aten.stack.default for n in nodes) == len(list(_state_names(model.layers)))
    assert_trees_close(ep.module()(x, mask), run_loop(model.layers, x, attn_mask=mask), atol=1e-5, rtol=1e-4)


def _state_names(layers):
    yield from (n for n, _ in layers[0].named_parameters())


def test_copies_of_one_layer_are_fine():
    base = DecoderBlock()
    layers = torch.nn.ModuleList(copy.deepcopy(base) for _ in range(3))
    x = torch.randn(1, 3, 32)
    assert_trees_close(scan_layers(layers, x), run_loop(layers, x), atol=1e-5, rtol=1e-4)


def test_xla_matches_cpu_and_grads_land_on_each_layer():
    if torch_xla is None:
        pytest.skip("torch_xla is not installed")
    dev = torch_xla.device()
    layers = make_stack(8)
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    want = train_step(run_loop, layers, x, mask)
    layers_x = copy.deepcopy(layers).to(dev)
    layers_x.zero_grad()
    out = scan_layers(layers_x, x.to(dev), attn_mask=mask.to(dev))
    out.pow(2).mean().backward()
    grads_x = [p.grad for p in layers_x.parameters()]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads_x)
    assert hlo.count(" while(") == 2  # forward While + backward While, whatever the depth
    # per-layer gradients are gathered rows: XLA compiles each slice output slowly (O(depth) seconds)
    assert " slice(" not in hlo[hlo.index("ENTRY"):]
    torch_xla.sync()  # one graph for all gradients, not one per .cpu()
    assert_trees_close((out.detach().cpu(), [g.cpu() for g in grads_x]), want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile_backends_train_like_the_loop(backend):
    layers = make_stack(4)
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    want = train_step(run_loop, layers, x, mask)
    torch._dynamo.reset()
    compiled = torch.compile(lambda l, x, **kw: scan_layers(l, x, **kw), backend=backend, fullgraph=True)
    assert_trees_close(train_step(compiled, layers, x, mask), want, atol=1e-5, rtol=1e-4)
