"""Layer kinds told apart before the scan (``layers.one_code``): where every kind's code traces to
one graph, the step runs one layer's code with no cond; the attributes that tell the kinds apart
are excused from the check on read, per-layer data (a value per layer) is not.

Told outside any trace (an eager call on XLA tensors: those tests need torch_xla) and under
Dynamo, by its tracker at trace time (``layers.trace_time``), on the CPU; elsewhere (make_fx)
the cond runs."""
import pytest
import torch

from torch_scan_hop.core.trees import ScanError
from torch_scan_hop.layers import one_code

KINDS = ["sliding", "sliding", "full"] * 2 + ["sliding"]


def _ignores(z, window=None):
    return z


class Layer(torch.nn.Module):
    """Gemma 3's shape of the question: ``window`` is read and handed to code that ignores it;
    ``idx`` is per-layer data (a value per layer), used by the code only at ``special``."""

    def __init__(self, kind, idx, special=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kind, self.idx, self.special = kind, idx, special
        self.window = 3 if kind == "sliding" else None

    def forward(self, h):
        z = torch.tanh(_ignores(self.lin(h), window=self.window))
        if self.special is not None and self.idx == self.special:
            z = z * 2  # a layer whose code differs by its index: not the kinds' first layers
        return h + z


def _stack(special=None):
    torch.manual_seed(0)
    return torch.nn.ModuleList([Layer(k, i, special) for i, k in enumerate(KINDS)])


def test_excused_paths_are_what_tells_the_kinds_apart():
    kinds = [0 if k == "sliding" else 1 for k in KINDS]
    assert one_code.excused_paths(list(_stack()), kinds) == {"kind", "window"}  # not idx: a value per layer


def _loop_values_and_grads(layers, h0):
    """The plain loop over ``layers``: its output and the gradients of ``h0`` and every parameter."""
    h = h0.clone().requires_grad_()
    out = h
    for layer in layers:
        out = layer(out)
    return out, torch.autograd.grad(out.square().sum(), [h, *layers.parameters()])


def _on_xla():
    pytest.importorskip("torch_xla", reason="one_code decides only outside a trace: an eager call on XLA tensors")
    from xla_util import DEV
    return DEV


def test_kinds_that_trace_alike_run_one_code():
    from torch_scan_hop import scan_layers
    from xla_util import to_cpu

    dev = _on_xla()
    h0 = torch.randn(2, 4)
    want, want_grads = _loop_values_and_grads(_stack(), h0)
    layers = _stack().to(dev)
    before = one_code.counts().get("alike", 0)
    h = h0.to(dev).requires_grad_()
    got = scan_layers(layers, h, period="auto")
    grads = torch.autograd.grad(got.square().sum(), [h, *layers.parameters()])
    assert one_code.counts().get("alike", 0) > before
    torch.testing.assert_close(to_cpu(got), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(to_cpu(grads), want_grads, atol=1e-5, rtol=1e-5)


def test_per_layer_data_that_changes_the_code_is_refused():
    """Layer 4 (a "sliding" one) doubles its output by its index: the kinds' first layers (0, 2)
    trace alike, and reading ``idx`` is checked against every layer: a ScanError, not layer 0's
    code for layer 4."""
    from torch_scan_hop import scan_layers

    dev = _on_xla()
    layers = _stack(special=4).to(dev)
    with pytest.raises(ScanError, match="idx"):
        scan_layers(layers, torch.randn(2, 4).to(dev), period="auto")


def _compiled_with_graphs(fn, *args):
    from torch._dynamo.backends.common import aot_autograd

    graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm.forward,
                           bw_compiler=lambda gm, _: gm.forward)
    return torch.compile(fn, backend=backend, fullgraph=True)(*args), graphs


def _conds(gm):
    found = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.cond]
    return found + [n for sub in gm.children() if isinstance(sub, torch.fx.GraphModule) for n in _conds(sub)]


def test_under_dynamo_the_kinds_are_told_at_trace_time(fresh_dynamo):
    """Compiled with no eager call before (nothing cached on the stack): the kinds and whether they
    trace alike are read at trace time; the body is one layer's code, no cond; values and
    gradients are the loop's."""
    from torch_scan_hop import scan_layers

    layers, h0 = _stack(), torch.randn(2, 4)
    want, want_grads = _loop_values_and_grads(layers, h0)
    before = one_code.counts().get("alike", 0)
    h = h0.clone().requires_grad_()
    got, graphs = _compiled_with_graphs(lambda h: scan_layers(layers, h, period="auto"), h)
    grads = torch.autograd.grad(got.square().sum(), [h, *layers.parameters()])
    assert one_code.counts().get("alike", 0) > before
    assert graphs and not [n for gm in graphs for n in _conds(gm)]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grads, want_grads)


def test_under_dynamo_per_layer_data_that_changes_the_code_is_refused(fresh_dynamo):
    from torch_scan_hop import scan_layers

    layers = _stack(special=4)
    with pytest.raises(ScanError, match="idx"):
        _compiled_with_graphs(lambda h: scan_layers(layers, h, period="auto"), torch.randn(2, 4))
