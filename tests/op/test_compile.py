"""torch.compile: one Dynamo node, every backend equal to eager, dynamic length, compiled autograd."""
import json
import os
import subprocess
import sys
import textwrap

import _isolated
import expecttest
import pytest
import torch
from conftest import assert_trees_close, capture_graphs, loops_in, reference_scan
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from torch_scan_hop import ScanError, scan


class RNN(torch.nn.Module):
    def __init__(self, h=4):
        super().__init__()
        self.lin = torch.nn.Linear(h, h)

    def forward(self, h0, xs):
        return scan(lambda h, x: (torch.tanh(self.lin(h) + x), h.sum(-1)), h0, xs)


def scan_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class TestGraphs(expecttest.TestCase):
    def test_dynamo_graph_is_one_scan_node_with_explicit_parameters(self):
        torch.manual_seed(0)
        model = RNN()
        graphs, backend = capture_graphs()
        h0, xs = torch.zeros(2, 4), torch.randn(5, 2, 4)
        out = torch.compile(model, backend=backend, fullgraph=True)(h0, xs)
        assert_trees_close(out, model(h0, xs))
        self.assertEqual(len(graphs), 1)
        self.assertEqual(dict(counters["stats"]), {"calls_captured": 3, "unique_graphs": 1})
        self.assertEqual(dict(counters["graph_break"]), {})
        self.assertEqual(len(scan_nodes(graphs[0])), 1)
        self.assertExpectedInline(graphs[0].code.strip(), """\
def forward(self, L_h0_ : torch.Tensor, L_xs_ : torch.Tensor, L_self_modules_lin_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_lin_parameters_bias_ : torch.nn.parameter.Parameter):
    l_h0_ = L_h0_
    l_xs_ = L_xs_
    l_self_modules_lin_parameters_weight_ = L_self_modules_lin_parameters_weight_
    l_self_modules_lin_parameters_bias_ = L_self_modules_lin_parameters_bias_
    scan_body_0 = self.scan_body_0
    scan = torch.ops.higher_order.scan(scan_body_0, [l_h0_], [l_xs_], (l_self_modules_lin_parameters_weight_, l_self_modules_lin_parameters_bias_));  scan_body_0 = l_h0_ = l_xs_ = l_self_modules_lin_parameters_weight_ = l_self_modules_lin_parameters_bias_ = None
    getitem = scan[0]
    getitem_1 = scan[1];  scan = None
    return (getitem, getitem_1)""")
        body = getattr(graphs[0], scan_nodes(graphs[0])[0].args[0].target)
        self.assertExpectedInline(body.code.strip(), """\
def forward(self, clone : torch.Tensor, zeros : torch.Tensor, l_self_modules_lin_parameters_weight_ : torch._subclasses.fake_tensor.FakeTensor, l_self_modules_lin_parameters_bias_ : torch._subclasses.fake_tensor.FakeTensor):
    linear = torch._C._nn.linear(clone, l_self_modules_lin_parameters_weight_, l_self_modules_lin_parameters_bias_);  l_self_modules_lin_parameters_weight_ = l_self_modules_lin_parameters_bias_ = None
    add = linear + zeros;  linear = zeros = None
    new_carry = torch.tanh(add);  add = None
    y = clone.sum(-1);  clone = None
    return (new_carry, y)""")

    def test_aot_forward_and_backward_graphs(self):
        torch.manual_seed(0)
        model = RNN()
        fw, bw = [], []
        backend = aot_autograd(fw_compiler=lambda gm, _: fw.append(gm) or gm.forward,
                               bw_compiler=lambda gm, _: bw.append(gm) or gm.forward)
        h0, xs = torch.zeros(2, 4), torch.randn(5, 2, 4)
        c, ys = torch.compile(model, backend=backend, fullgraph=True)(h0, xs)
        (c.sum() + ys.sum()).backward()
        self.assertEqual([len(scan_nodes(g)) for g in fw + bw], [1, 1])
        self.assertExpectedInline(fw[0].code.strip(), """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    scan_combine_graph_0 = self.scan_combine_graph_0
    scan = torch.ops.higher_order.scan(scan_combine_graph_0, [primals_1], [primals_2], (primals_3, primals_4));  scan_combine_graph_0 = primals_1 = primals_2 = None
    getitem = scan[0]
    getitem_1 = scan[1]
    getitem_2 = scan[2]
    getitem_3 = scan[3];  scan = None
    return (getitem, getitem_1, primals_3, primals_4, getitem_2, getitem_3)""")
        self.assertExpectedInline(bw[0].code.strip(), """\
def forward(self, primals_3, primals_4, getitem_2, getitem_3, tangents_1, tangents_2):
    zeros_like = torch.ops.aten.zeros_like.default(primals_3, pin_memory = False)
    zeros_like_1 = torch.ops.aten.zeros_like.default(primals_4, pin_memory = False);  primals_4 = None
    scan_combine_graph_1 = self.scan_combine_graph_1
    scan_1 = torch.ops.higher_order.scan(scan_combine_graph_1, [tangents_1, zeros_like, zeros_like_1], [getitem_2, getitem_3, tangents_2], (primals_3,), reverse = True);  scan_combine_graph_1 = tangents_1 = zeros_like = zeros_like_1 = getitem_2 = getitem_3 = tangents_2 = primals_3 = None
    getitem_5 = scan_1[1]
    getitem_6 = scan_1[2];  scan_1 = None
    return (None, None, getitem_5, getitem_6)""")


def body_with_everything(w):
    def body(c, x):
        h = torch.sin(c["h"] @ w) * x["a"] + x["b"]
        return {"h": h, "n": c["n"] + 1}, {"s": h.sum(-1), "none": None, "n": c["n"]}
    return body


def everything_inputs(grad=True):
    torch.manual_seed(3)
    w = torch.randn(3, 3, requires_grad=grad)
    init = {"h": torch.randn(2, 3, requires_grad=grad), "n": torch.tensor(0)}
    xs = {"a": torch.randn(6, 2, 3), "b": torch.randn(6, 2, 3, requires_grad=grad)}
    return w, init, xs


def loss_and_grads(fn, w, init, xs):
    carry, ys = fn(init, xs)
    loss = carry["h"].pow(2).sum() + ys["s"].sum()
    return [carry, ys, *torch.autograd.grad(loss, [w, init["h"], xs["b"]])]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("reverse", [False, True])
def test_backends_match_eager_forward_and_backward(backend, reverse):
    w, init, xs = everything_inputs()

    def f(init, xs):
        return scan(body_with_everything(w), init, xs, reverse=reverse)

    want = loss_and_grads(f, w, init, xs)
    got = loss_and_grads(torch.compile(f, backend=backend, fullgraph=True), w, init, xs)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


class _LinearSkippingGrads(torch.autograd.Function):
    """Computes only the gradients ``ctx.needs_input_grad`` asks for (as torch_xla's XLAPatchedLinear)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g @ w if ctx.needs_input_grad[0] else None), (g.t() @ x if ctx.needs_input_grad[1] else None)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("init_grad", [False, True])
def test_autograd_function_sees_the_carry_require_grad_from_step_two_on(backend, init_grad):
    """init does not require grad, so step 1's carry does not; from step 2 on it
    does (it depends on w). The body is traced with the carry requiring grad, or
    the Function's backward drops the gradient through the carry (all steps but the last)."""
    torch.manual_seed(0)
    w0, init0, xs = torch.randn(4, 4, dtype=torch.float64) * 0.5, torch.randn(2, 4, dtype=torch.float64), \
        torch.randn(5, 2, 4, dtype=torch.float64)

    def f(w, init, xs):
        return scan(lambda c, x: (torch.tanh(_LinearSkippingGrads.apply(c, w) + x), c.sum(-1)), init, xs)

    def grads(fn):
        w, init = w0.clone().requires_grad_(), init0.clone().requires_grad_(init_grad)
        c, ys = fn(w, init, xs)
        wrt = [w, init] if init_grad else [w]
        return [c, ys, *torch.autograd.grad(c.pow(2).sum() + ys.sin().sum(), wrt)]

    want = grads(lambda w, init, xs: reference_scan(lambda c, x: (torch.tanh(_LinearSkippingGrads.apply(c, w) + x),
                                                                 c.sum(-1)), init, xs))
    assert_trees_close(grads(f), want, atol=1e-10, rtol=1e-10)
    assert_trees_close(grads(torch.compile(f, backend=backend, fullgraph=True)), want, atol=1e-10, rtol=1e-10)


INDUCTOR_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch._inductor.fx_passes.post_grad  # inductor and Dynamo's HOP table first:
    import torch._dynamo.variables.higher_order_ops  # import order must not matter
    import torch
    from torch._inductor.utils import run_and_get_code
    import torch_scan_hop
    sys.path[:0] = sys.argv[1].split(os.pathsep)
    from test_compile import body_with_everything, everything_inputs, loss_and_grads
    from conftest import loops_in

    w, init, xs = everything_inputs()
    f = lambda init, xs: torch_scan_hop.scan(body_with_everything(w), init, xs, reverse=True)
    want = loss_and_grads(f, w, init, xs)
    got = loss_and_grads(torch.compile(f, backend="inductor", fullgraph=True), w, init, xs)
    flat = lambda t: [v for v in torch.utils._pytree.tree_leaves(t) if v is not None]
    err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(flat(got), flat(want)))
    code_lines = []
    for n in (64, 256):  # a rolled loop: the generated code does not grow with the length
        torch._dynamo.reset()
        g = lambda c, xs: torch_scan_hop.scan(lambda c, x: (torch.tanh(c @ w.detach() + x), c.sum()), c, xs)
        _, codes = run_and_get_code(torch.compile(g, backend="inductor"), torch.zeros(2, 3), torch.randn(n, 2, 3))
        code = " ".join(codes)
        code_lines.append((loops_in(code), code.count("tanh")))
    print(json.dumps({"err": err, "code_lines": code_lines}))
""")


def test_inductor_matches_eager_keeps_loop_rolled_and_ignores_import_order():
    out = subprocess.run([sys.executable, "-c", INDUCTOR_SCRIPT, os.pathsep.join(_isolated.TEST_PATH)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["err"] < 1e-4
    short, long = result["code_lines"]
    assert short == long and short[0] >= 1  # a while loop; as many tanh sites for 64 steps as for 256


def test_upstream_front_end_under_compile_runs_on_our_op():
    from torch._higher_order_ops.scan import scan as upstream_scan

    w = torch.randn(4, 4)
    cell = lambda c, x: (torch.tanh(c @ w + x), c.sum(-1))  # noqa: E731
    graphs, backend = capture_graphs()
    c0, xs = torch.zeros(2, 4), torch.randn(5, 2, 4)
    got = torch.compile(lambda c, xs: upstream_scan(cell, c, xs), backend=backend, fullgraph=True)(c0, xs)
    assert_trees_close(list(got), list(scan(cell, c0, xs)))
    assert len(scan_nodes(graphs[0])) == 1


def test_graph_break_in_body_is_a_hard_error_naming_the_body():
    def f(c, xs):
        def body(c, x):
            print("side effect")
            return c + x, c
        return scan(body, c, xs)

    with pytest.raises(ScanError, match=r"torch_scan_hop.scan: the body fn must be captured whole"):
        torch.compile(f, backend="eager")(torch.zeros(2), torch.randn(3, 2))


def test_non_tensor_y_leaf_is_rejected_under_compile():
    def f(c, xs):
        return scan(lambda c, x: (c + x, 3), c, xs)

    with pytest.raises(ScanError, match="non-tensor value 3"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2), torch.randn(3, 2))


def test_zero_length_under_compile():
    w = torch.randn(2, 2)
    f = lambda c, xs: scan(lambda c, x: (c @ w + x, c.sum()), c, xs)  # noqa: E731
    c, ys = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.ones(2), torch.randn(0, 2))
    assert torch.equal(c, torch.ones(2)) and ys.shape == (0,)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_zero_length_leaves_closure_and_xs_grads_none_as_the_loop(backend):
    """No step ran: the loop never used the closed-over weight nor xs, so their .grad stays None
    (an optimizer skips a None gradient but decays or moves a zero one); init's is the carry's."""
    w, xs = torch.randn(2, 2, requires_grad=True), torch.randn(0, 2, requires_grad=True)
    c0 = torch.ones(2, requires_grad=True)
    f = lambda c, xs: scan(lambda c, x: (torch.tanh(c @ w + x), c.sum()), c, xs)  # noqa: E731
    c, ys = torch.compile(f, backend=backend, fullgraph=True)(c0, xs)
    (c.sum() * 3 + ys.sum()).backward()
    assert w.grad is None and xs.grad is None, (w.grad, xs.grad)
    assert torch.equal(c0.grad, torch.full((2,), 3.0))


def test_compiled_autograd_captures_the_backward_scan():
    torch.manual_seed(0)
    model = RNN()
    h0, xs = torch.zeros(2, 4), torch.randn(5, 2, 4)
    c, ys = model(h0, xs)
    (c.sum() + ys.sum()).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
        c, ys = compiled(h0, xs)
        (c.sum() + ys.sum()).backward()
    assert counters["compiled_autograd"]["captures"] == 1
    assert not counters["graph_break"]
    assert_trees_close([p.grad for p in model.parameters()], want, atol=1e-6, rtol=1e-5)


BAD_BODIES = {  # case: (fn, scan options, message)
    "carry shape": (lambda c, x: (torch.cat([c, x]), c), {},
                    r"carry leaf carry changed across an iteration: shape \(4,\) vs init's \(2,\)"),
    "carry dtype": (lambda c, x: (c.double() + x, c), {},
                    r"carry leaf carry changed across an iteration: dtype torch.float64 vs init's torch.float32"),
    "data-dependent branch": (lambda c, x: (c + x if c.sum() > 0 else c - x, c), {},
                              r"body fn must be captured whole by torch.compile .*Data-dependent branching"),
    "callable remat": (lambda c, x: (c + x, c), {"remat": lambda joint, inputs, *, num_fwd_outputs: None},
                       r"remat=<callable> is not supported under torch.compile"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_body_is_a_scan_error_under_fullgraph_compile(case):
    """A ScanError with scan's own message, not Dynamo's InternalTorchDynamoError around it."""
    fn, options, message = BAD_BODIES[case]
    with pytest.raises(ScanError, match=message):
        torch.compile(lambda c, xs: scan(fn, c, xs, **options), backend="eager", fullgraph=True)(
            torch.zeros(2), torch.randn(3, 2))



@pytest.mark.parametrize("unroll", [2, 4, 7])
def test_unroll_under_compile_is_a_blocked_loop_with_same_values(unroll):
    w, init, xs = everything_inputs()
    fw = []
    backend = aot_autograd(fw_compiler=lambda gm, _: fw.append(gm) or gm.forward)

    def f(init, xs):
        return scan(body_with_everything(w), init, xs, reverse=True, unroll=unroll)

    want = loss_and_grads(f, w, init, xs)
    got = loss_and_grads(torch.compile(f, backend=backend, fullgraph=True), w, init, xs)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-5)
    # length 6: one scan over blocks of `unroll` steps, plus a remainder scan unless it divides 6
    # (unroll > length: a plain scan)
    assert len(scan_nodes(fw[0])) == (2 if unroll < 6 and 6 % unroll else 1)


@pytest.mark.parametrize("unroll,length,steps_per_iteration", [(None, 32, 1), (None, 12, 1), (1, 32, 1), (4, 32, 4)])
def test_default_unroll_is_one_step_per_iteration_under_compile(unroll, length, steps_per_iteration):
    """unroll=None is 1 under torch.compile too (blocks of steps no longer pay off since the
    inductor loop runs at the compiled loop's speed; see benchmarks/compile.py)."""
    w = torch.randn(3, 3)
    graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm.forward)

    def f(c, xs):
        return scan(lambda c, x: (torch.tanh(c @ w + x), c.sum()), c, xs, unroll=unroll)

    c0, xs = torch.zeros(2, 3), torch.randn(length, 2, 3)
    assert_trees_close(torch.compile(f, backend=backend, fullgraph=True)(c0, xs), f(c0, xs))
    (node,) = scan_nodes(graphs[0])
    body = getattr(graphs[0], node.args[0].target)
    assert sum(n.target is torch.ops.aten.tanh.default for n in body.graph.nodes) == steps_per_iteration


def test_scan_without_ys_compiles_with_inductor():
    """Inductor's scan->while_loop rewrite needs at least one y; the proxy rule adds a scalar one."""
    w = torch.randn(4, 4)

    def f(c, xs):
        return scan(lambda c, x: (torch.tanh(c @ w + x), None), c, xs)

    c0, xs = torch.zeros(2, 4), torch.randn(20, 2, 4)
    with torch.no_grad():
        c, ys = torch.compile(f, backend="inductor", fullgraph=True)(c0, xs)
    assert ys is None
    torch.testing.assert_close(c, f(c0, xs)[0])


def test_tracker_that_cannot_be_built_warns_and_leaves_upstream_in_place(monkeypatch):
    """On a torch whose Dynamo internals moved, importing must not crash: it warns."""
    from torch._dynamo.variables import higher_order_ops as hops

    from torch_scan_hop.op import dynamo as rule_dynamo

    ours = hops._hop_name_to_variable_class["scan"]
    monkeypatch.setitem(hops._hop_name_to_variable_class, "scan", ours.upstream)

    def moved():
        raise AttributeError("module has no attribute 'speculate_subgraph'")

    monkeypatch.setattr(rule_dynamo, "_make_tracker_class", moved)
    with pytest.warns(UserWarning, match="supports torch 2.9.*speculate_subgraph"):
        rule_dynamo.install()
    assert hops._hop_name_to_variable_class["scan"] is ours.upstream


@pytest.mark.parametrize("case", ["training", "reverse_no_ys", "zero_length", "dynamic", "unroll", "unroll_exact"])
def test_inductor_lowers_reverse_scans_in_place_without_flips(case):
    """A reverse scan (every training backward) reads and writes slice L-1-i in the
    while loop: no flip or gather of xs, no flip of ys (copies of every saved activation)."""
    from torch._inductor.utils import run_and_get_code

    w = torch.randn(4, 4, requires_grad=True)
    n = {"zero_length": 0, "dynamic": 7, "unroll": 7}.get(case, 6)
    c0, xs = torch.randn(2, 4, requires_grad=True), torch.randn(n, 2, 4, requires_grad=True)
    reverse = case != "training"  # "training": a forward scan, whose backward is the reverse scan
    unroll = 3 if case.startswith("unroll") else 1  # 7 = two blocks of 3 + a remainder step

    def step(c0, xs):
        ys_fn = (lambda c: None) if case == "reverse_no_ys" else (lambda c: c.sum(-1))
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), ys_fn(c)), c0, xs, reverse=reverse, unroll=unroll)
        loss = c.pow(2).sum() + (0 if ys is None else ys.pow(2).sum())
        # zero length: nothing reaches w or xs (the loop's None), zeros like the loop's
        return [c, ys, *torch.autograd.grad(loss, [c0, xs, w], allow_unused=True, materialize_grads=True)]

    want = step(c0, xs)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="inductor", dynamic=case == "dynamic")
    got, codes = run_and_get_code(compiled, c0, xs)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-4)
    code = "\n".join(codes)
    assert "flip" not in code and "index_select" not in code
    loops = {0: 0, 6: 2, 7: 2 if unroll == 1 else 4}[n]  # forward and backward; blocks + remainder
    assert loops_in(code) == loops
    if case == "dynamic":
        xs9 = torch.randn(9, 2, 4, requires_grad=True)
        assert_trees_close(compiled(c0, xs9), step(c0, xs9), atol=1e-5, rtol=1e-4)
