"""torch.export: one scan node over explicit parameters/buffers/constants; save/load; Dim on the length."""
import io

import expecttest
import pytest
import torch
from conftest import assert_trees_close

from torch_scan_hop import scan


class ScaledRNN(torch.nn.Module):
    """Parameters (lin), a buffer (scale) and a plain tensor attribute (bias_k) closed over."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(0.5))
        self.bias_k = torch.randn(4)

    def forward(self, h0, xs):
        k = self.bias_k

        def cell(h, x):
            h = torch.tanh(self.lin(h) * self.scale + x + k)
            return h, {"s": h.sum(-1), "none": None}

        return scan(cell, h0, xs, reverse=True)


def scan_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]


def round_trip(ep):
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


@pytest.mark.parametrize("strict", [True, False])
def test_export_save_load_and_dynamic_length(strict):
    torch.manual_seed(0)
    model = ScaledRNN()
    h0, xs = torch.zeros(2, 4), torch.randn(5, 2, 4)
    length = torch.export.Dim("length", min=1, max=1024)
    ep = torch.export.export(model, (h0, xs), strict=strict, dynamic_shapes={"h0": None, "xs": {0: length}})
    assert len(scan_nodes(ep.graph_module)) == 1
    loaded = round_trip(ep)
    for n in (5, 9, 1):
        xs_n = torch.randn(n, 2, 4)
        assert_trees_close(loaded.module()(h0, xs_n), model(h0, xs_n), atol=1e-6, rtol=1e-5)
    decomposed = ep.run_decompositions()
    assert len(scan_nodes(decomposed.graph_module)) == 1
    assert_trees_close(decomposed.module()(h0, xs), model(h0, xs), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("strict", [True, False])
def test_export_with_a_dynamic_batch_and_trainable_closure(strict):
    """A symbolic batch through a body with a parameter that requires grad: exporting must not
    trace a backward for the node (its sizes, 3*batch inside matmul, are not the tracer's)."""
    torch.manual_seed(0)
    model = ScaledRNN()
    h0, xs = torch.zeros(3, 4), torch.randn(5, 3, 4)
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(model, (h0, xs), strict=strict, dynamic_shapes={"h0": {0: batch}, "xs": {1: batch}})
    loaded = round_trip(ep)
    for b in (3, 7):
        h0_b, xs_b = torch.randn(b, 4), torch.randn(5, b, 4)
        assert_trees_close(loaded.module()(h0_b, xs_b), model(h0_b, xs_b), atol=1e-6, rtol=1e-5)


class TestExportedGraph(expecttest.TestCase):
    def test_exported_graph(self):
        torch.manual_seed(0)
        ep = torch.export.export(ScaledRNN(), (torch.zeros(2, 4), torch.randn(5, 2, 4)), strict=False)
        self.assertExpectedInline(ep.graph_module.code.strip(), """\
def forward(self, p_lin_weight, p_lin_bias, b_scale, c_bias_k, h0, xs):
    arange = torch.ops.aten.arange.start_step(4, -1, -1, device = device(type='cpu'), pin_memory = False)
    scan_combine_graph_0 = self.scan_combine_graph_0
    scan = torch.ops.higher_order.scan(scan_combine_graph_0, [h0], [arange], (p_lin_weight, p_lin_bias, b_scale, c_bias_k, xs));  scan_combine_graph_0 = h0 = arange = p_lin_weight = p_lin_bias = b_scale = c_bias_k = xs = None
    getitem = scan[0]
    getitem_1 = scan[1];  scan = None
    flip = torch.ops.aten.flip.default(getitem_1, [0]);  getitem_1 = None
    return (getitem, flip, None)""")
        body = getattr(ep.graph_module, scan_nodes(ep.graph_module)[0].args[0].target)
        self.assertExpectedInline(body.code.strip(), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1):
    reshape = torch.ops.aten.reshape.default(arg1_1, [1]);  arg1_1 = None
    index_select = torch.ops.aten.index_select.default(arg6_1, 0, reshape);  arg6_1 = reshape = None
    squeeze = torch.ops.aten.squeeze.dim(index_select, 0);  index_select = None
    linear = torch.ops.aten.linear.default(arg0_1, arg2_1, arg3_1);  arg0_1 = arg2_1 = arg3_1 = None
    mul = torch.ops.aten.mul.Tensor(linear, arg4_1);  linear = arg4_1 = None
    add = torch.ops.aten.add.Tensor(mul, squeeze);  mul = squeeze = None
    add_1 = torch.ops.aten.add.Tensor(add, arg5_1);  add = arg5_1 = None
    tanh = torch.ops.aten.tanh.default(add_1);  add_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(tanh, [-1])
    return [tanh, sum_1]""")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length,unroll,nodes", [(7, 3, 2), (6, 3, 1), (0, 2, 0)])
def test_export_follows_the_schedule(reverse, length, unroll, nodes):
    """unroll=k exports blocks of k steps plus a remainder scan (a reverse scan gathers its slices
    by index in both); a scan without steps exports no scan node. Values match the loop."""
    w = torch.randn(4, 4)

    class Cell(torch.nn.Module):
        def forward(self, h0, xs):
            return scan(lambda h, x: (torch.tanh(h @ w + x), h * x), h0, xs, reverse=reverse, unroll=unroll)

    h0, xs = torch.randn(2, 4), torch.randn(length, 2, 4)
    ep = torch.export.export(Cell(), (h0, xs), strict=False)
    assert len(scan_nodes(ep.graph_module)) == nodes
    assert_trees_close(round_trip(ep).module()(h0, xs), Cell()(h0, xs), atol=1e-6, rtol=1e-5)


class NoGradInBody(torch.nn.Module):
    """A body with a ``torch.no_grad()`` region: its value feeds the carry but not the gradient."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, h0, xs):
        def cell(h, x):
            with torch.no_grad():
                s = h * 2
            return torch.tanh(h @ self.w + x + s), s
        return scan(cell, h0, xs)


@pytest.mark.parametrize("strict", [True, False])
def test_export_of_a_body_with_a_no_grad_region_loads(strict):
    """The body's grad-mode switches belong to its subgraph; non-strict export also recorded them
    in the outer graph as an empty region that torch.export.load refused."""
    torch.manual_seed(0)
    model = NoGradInBody()
    h0, xs = torch.randn(2, 3), torch.randn(5, 2, 3)
    ep = torch.export.export(model, (h0, xs), strict=strict)
    assert [n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"
            and "set_grad" in str(n.target)] == []
    loaded = round_trip(ep)
    assert_trees_close(loaded.module()(h0, xs), model(h0, xs), atol=1e-6, rtol=1e-5)
    h = h0.clone().requires_grad_()
    want = torch.autograd.grad(model(h, xs)[0].sum(), h)
    assert_trees_close(torch.autograd.grad(loaded.module()(h, xs)[0].sum(), h), want, atol=1e-6, rtol=1e-5)
