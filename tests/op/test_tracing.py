"""make_fx emits ONE scan node with the body as a subgraph; fake and functionalize rules."""
import expecttest
import pytest
import torch
from conftest import assert_trees_close, reference_scan
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import ScanError, scan
from torch_scan_hop.op.hop import scan_op

W = torch.randn(4, 4)


def rnn(c, x):
    c = torch.tanh(c @ W + x)
    return c, c.sum(-1)


def tree_body(c, x):
    h = torch.sigmoid(c["h"] * x["a"]) + x["b"]
    return {"h": h, "n": c["n"] + 1}, {"mean": h.mean(-1), "n": c["n"]}


def scan_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is scan_op]


def trace(f, *args, mode="fake"):
    return make_fx(f, tracing_mode=mode, _allow_non_fake_inputs=True)(*args)


class TestGraphs(expecttest.TestCase):
    def test_rnn_graph_with_lifted_closure(self):
        gm = trace(lambda c, xs: scan(rnn, c, xs), torch.zeros(2, 4), torch.randn(5, 2, 4))
        self.assertEqual(len(scan_nodes(gm)), 1)
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, c_1, xs_1):
    scan_combine_graph_0 = self.scan_combine_graph_0
    _tensor_constant0 = self._tensor_constant0
    scan = torch.ops.higher_order.scan(scan_combine_graph_0, [c_1], [xs_1], (_tensor_constant0,));  scan_combine_graph_0 = c_1 = xs_1 = _tensor_constant0 = None
    getitem = scan[0]
    getitem_1 = scan[1];  scan = None
    return (getitem, getitem_1)""")
        self.assertExpectedInline(gm.scan_combine_graph_0.code.strip(), """\
def forward(self, arg0_1, arg1_1, arg2_1):
    mm = torch.ops.aten.mm.default(arg0_1, arg2_1);  arg0_1 = arg2_1 = None
    add = torch.ops.aten.add.Tensor(mm, arg1_1);  mm = arg1_1 = None
    tanh = torch.ops.aten.tanh.default(add);  add = None
    sum_1 = torch.ops.aten.sum.dim_IntList(tanh, [-1])
    return [tanh, sum_1]""")

    def test_pytree_reverse_graph(self):
        init = {"h": torch.zeros(3), "n": torch.tensor(0)}
        xs = {"a": torch.randn(4, 3), "b": torch.randn(4, 3)}
        gm = trace(lambda i, x: scan(tree_body, i, x, reverse=True), init, xs)
        self.assertEqual(len(scan_nodes(gm)), 1)
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, i, x):
    i_1, i_2, x_1, x_2, = fx_pytree.tree_flatten_spec([i, x], self._in_spec)
    scan_combine_graph_0 = self.scan_combine_graph_0
    scan = torch.ops.higher_order.scan(scan_combine_graph_0, [i_1, i_2], [x_1, x_2], (), reverse = True);  scan_combine_graph_0 = i_1 = i_2 = x_1 = x_2 = None
    getitem = scan[0]
    getitem_1 = scan[1]
    getitem_2 = scan[2]
    getitem_3 = scan[3];  scan = None
    return pytree.tree_unflatten([getitem, getitem_1, getitem_2, getitem_3], self._out_spec)""")
        self.assertExpectedInline(gm.scan_combine_graph_0.code.strip(), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1):
    mul = torch.ops.aten.mul.Tensor(arg0_1, arg2_1);  arg0_1 = arg2_1 = None
    sigmoid = torch.ops.aten.sigmoid.default(mul);  mul = None
    add = torch.ops.aten.add.Tensor(sigmoid, arg3_1);  sigmoid = arg3_1 = None
    add_1 = torch.ops.aten.add.Tensor(arg1_1, 1)
    mean = torch.ops.aten.mean.dim(add, [-1])
    clone_default = torch.ops.aten.clone.default(arg1_1);  arg1_1 = None
    return [add, add_1, mean, clone_default]""")

    def test_one_iteration_means_a_single_block_of_every_step(self):
        """``schedule.one_iteration``: the XLA lowering's straight-line case (one segment whose
        block is every step), which scan_layers asks before choosing its gradient rows."""
        from torch_scan_hop.core import schedule

        cases = [(8, 8, True), (8, 9, True), (8, 4, False), (8, 1, False), (7, 3, False), (1, 1, True),
                 (0, 4, False), (8, True, False)]
        self.assertEqual([schedule.one_iteration(n, k) for n, k, _ in cases], [want for _, _, want in cases])

    def test_unrolled_reverse_graph_runs_blocks_then_remainder(self):
        """The layout of _schedule.segments: 7 steps as blocks of 3 over indices 1..6, run first
        (one reverse=True node, each block last slice first), then index 0; ys back in index order."""
        gm = trace(lambda c, xs: scan(rnn, c, xs, reverse=True, unroll=3), torch.zeros(2, 4), torch.randn(7, 2, 4))
        self.assertEqual(len(scan_nodes(gm)), 2)
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, c_1, xs_1):
    slice_1 = torch.ops.aten.slice.Tensor(xs_1, 0, 1, 7)
    view = torch.ops.aten.view.default(slice_1, [2, 3, 2, 4]);  slice_1 = None
    scan_combine_graph_0 = self.scan_combine_graph_0
    _tensor_constant0 = self._tensor_constant0
    scan = torch.ops.higher_order.scan(scan_combine_graph_0, [c_1], [view], (_tensor_constant0,), reverse = True);  scan_combine_graph_0 = c_1 = view = _tensor_constant0 = None
    getitem = scan[0]
    getitem_1 = scan[1];  scan = None
    view_1 = torch.ops.aten.view.default(getitem_1, [6, 2]);  getitem_1 = None
    slice_2 = torch.ops.aten.slice.Tensor(xs_1, 0, 0, 1);  xs_1 = None
    scan_combine_graph_1 = self.scan_combine_graph_1
    _tensor_constant0_1 = self._tensor_constant0
    scan_1 = torch.ops.higher_order.scan(scan_combine_graph_1, [getitem], [slice_2], (_tensor_constant0_1,), reverse = True);  scan_combine_graph_1 = getitem = slice_2 = _tensor_constant0_1 = None
    getitem_2 = scan_1[0]
    getitem_3 = scan_1[1];  scan_1 = None
    cat = torch.ops.aten.cat.default([getitem_3, view_1]);  getitem_3 = view_1 = None
    return (getitem_2, cat)""")

    def test_zero_length_scan_is_no_node(self):
        gm = trace(lambda c, xs: scan(rnn, c, xs, unroll=2), torch.zeros(2, 4), torch.randn(0, 2, 4))
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, c_1, xs_1):
    clone = torch.ops.aten.clone.default(c_1);  c_1 = None
    empty = torch.ops.aten.empty.memory_format([0, 2], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    return (clone, empty)""")


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
@pytest.mark.parametrize("reverse", [False, True])
def test_traced_graph_runs_and_matches_loop(mode, reverse):
    init, xs = torch.randn(2, 4), torch.randn(6, 2, 4)
    gm = trace(lambda c, x: scan(rnn, c, x, reverse=reverse), init, xs, mode=mode)
    assert len(scan_nodes(gm)) == 1
    (body_node,) = [n for n in gm.graph.nodes if n.op == "get_attr" and "scan_combine" in n.target]
    assert isinstance(getattr(gm, body_node.target), torch.fx.GraphModule)
    assert_trees_close(tuple(gm(init, xs)), reference_scan(rnn, init, xs, reverse=reverse))


def test_symbolic_trace_runs_other_lengths():
    init = torch.randn(2, 4)
    gm = trace(lambda c, x: scan(rnn, c, x), init, torch.randn(6, 2, 4), mode="symbolic")
    for n in (1, 3, 11):
        xs = torch.randn(n, 2, 4)
        assert_trees_close(tuple(gm(init, xs)), reference_scan(rnn, init, xs))


def _reads_closure_sizes(W0, W1):
    """A body that reads W0 only for its sizes (shape, numel, stride), W1 for its size and in an op.
    (Not len(W): Python makes it an int, which specializes the size in any trace.)"""
    def body(c, x):
        v = c.reshape(2, W0.shape[-1]) * W0.stride(0)
        h = torch.tanh(v.reshape(-1) + x * W1[: c.shape[0]].sum() + W1.size(0) + W1.nelement())
        return h, h.sum() * W0.numel()
    return body


def test_symbolic_trace_of_a_body_reading_only_closure_sizes():
    """Sizes of an outer trace's tensors are symbols the body's own trace has
    never seen; reading them must work (it crashed inside torch) and must not
    lift tensors only the package itself looked at (the init)."""
    def f(c, xs, W0, W1):
        final, ys = scan(_reads_closure_sizes(W0, W1), c, xs)
        grads = torch.autograd.grad((final.sum(), ys.sum()), (c, xs, W1))
        return final, ys, grads

    def want(c, xs, W0, W1):
        c, xs, W1 = (t.detach().requires_grad_() for t in (c, xs, W1))
        final, ys = reference_scan(_reads_closure_sizes(W0, W1), c, xs)
        return final, ys, torch.autograd.grad((final.sum(), ys.sum()), (c, xs, W1))

    def example(n, k, dtype=torch.float32):
        c, xs = torch.randn(2 * k, dtype=dtype, requires_grad=True), torch.randn(n, 2 * k, dtype=dtype, requires_grad=True)
        return c, xs, torch.randn(k + 1, k, dtype=dtype), torch.randn(2 * k + 1, dtype=dtype, requires_grad=True)

    gm = make_fx(f, tracing_mode="symbolic")(*example(5, 3))
    node = scan_nodes(gm)[0]  # the forward; a second one is its backward
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[0] not in node.args[3], "the init was lifted as a closure"
    for n, k in ((5, 3), (2, 4), (9, 2)):  # sizes all distinct in the traced example: no duck-sized equalities
        args = example(n, k, torch.float64)
        assert_trees_close(tuple(gm(*args)), want(*args))


def test_module_parameters_become_graph_inputs():
    cell = torch.nn.GRUCell(3, 3)
    gm = trace(lambda h, xs: scan(lambda h, x: (cell(x, h), None), h, xs), torch.zeros(2, 3), torch.randn(4, 2, 3))
    (node,) = scan_nodes(gm)
    lifted = [getattr(gm, a.target) for a in node.args[3]]
    assert {id(t) for t in lifted} == {id(p) for p in cell.parameters()}


def test_fake_mode_metadata_without_running_loop():
    calls = []

    def body(c, x):
        calls.append(1)
        return c + x, (c * x).to(torch.float64)

    with FakeTensorMode() as mode:
        init, xs = torch.zeros(3), torch.randn(1000, 3)
        carry, ys = scan(body, init, xs)
    assert ys.shape == (1000, 3) and ys.dtype == torch.float64 and carry.shape == (3,)
    assert len(calls) <= 2  # traced once (plus the lift trace), not 1000 times
    assert mode is not None


def test_functionalize_matches_and_takes_carry_writes():
    init, xs = torch.randn(2, 4), torch.randn(5, 2, 4)
    got = torch.func.functionalize(lambda c, x: scan(rnn, c, x))(init, xs)
    assert_trees_close(tuple(got), reference_scan(rnn, init, xs))

    def mutating(c, x):  # a write into the carry: the written value is the new carry (issue 63)
        c.add_(x)
        return c, c.clone()

    want = reference_scan(mutating, init.clone(), xs)
    assert_trees_close(tuple(torch.func.functionalize(lambda c, x: scan(mutating, c, x))(init.clone(), xs)), want)
    assert_trees_close(tuple(make_fx(lambda c, x: scan(mutating, c, x))(init.clone(), xs)(init.clone(), xs)), want)


def test_make_fx_takes_closure_writes():
    """A write into a closed-over tensor (issue 63): the graph leaves in it what the loop does."""
    buf = torch.zeros(4)

    def body(c, x):
        buf.add_(1)
        return c + buf, None

    gm = make_fx(lambda c, x: scan(body, c, x), _allow_non_fake_inputs=True)(torch.zeros(4), torch.zeros(3, 4))
    buf.zero_()
    got = gm(torch.zeros(4), torch.zeros(3, 4))
    got_buf, buf = buf, torch.zeros(4)  # the body now writes into a fresh buf (its closure cell)
    want = reference_scan(body, torch.zeros(4), torch.zeros(3, 4))
    assert_trees_close(got[0], want[0])
    torch.testing.assert_close(got_buf, buf)


@pytest.mark.parametrize("grad_mode", [True, False])
def test_make_fx_traces_the_body_in_the_callers_grad_mode(grad_mode):
    def body(c, x):
        return (c * 2 + x if torch.is_grad_enabled() else c * 3 + x), None

    init, xs = torch.ones(3), torch.ones(4, 3)
    with torch.set_grad_enabled(grad_mode):
        want = reference_scan(body, init, xs)[0]
        got = make_fx(lambda i, x: scan(body, i, x)[0])(init, xs)(init, xs)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("unroll", [1, 2, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_every_schedule_traces_to_the_loop_with_gradients(unroll, reverse):
    """Values and gradients (the backward is a reverse scan over its own schedule) for lengths
    that give no step, one step, fewer steps than a block, exact blocks and remainders."""
    w = torch.randn(4, 4, requires_grad=True)
    cell = lambda c, x: (torch.tanh(c @ w + x), c * x)  # noqa: E731

    def f(c0, xs, g_c, g_ys):
        c, ys = scan(cell, c0, xs, reverse=reverse, unroll=unroll)
        return [c, ys, *torch.autograd.grad((c, ys), (c0, xs, w), (g_c, g_ys), materialize_grads=True)]

    def loop(c0, xs, g_c, g_ys):
        c, ys = reference_scan(cell, c0, xs, reverse=reverse)
        if ys is None:  # no step: c is c0 itself
            return [c0.detach(), torch.zeros(0, 2, 4), g_c, torch.zeros_like(xs), torch.zeros_like(w)]
        return [c, ys, *torch.autograd.grad((c, ys), (c0, xs, w), (g_c, g_ys))]

    for n in (0, 1, 2, 3, 5, 7):
        args = (torch.randn(2, 4, requires_grad=True), torch.randn(n, 2, 4, requires_grad=True),
                torch.randn(2, 4), torch.randn(n, 2, 4))
        assert_trees_close(trace(f, *args, mode="real")(*args), loop(*args), atol=1e-5, rtol=1e-5)


def test_symbolic_trace_where_min_cut_saves_views_of_one_matmul():
    """q, k, v split from one matmul are saved once as their base; with symbolic sizes
    that choice compares symbolic byte counts, which must not be recorded in the trace
    (it crashed: "2*s9 is not tracked with proxy")."""
    W3 = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)

    def body(c, x):
        q, k, v = (c @ W3).chunk(3, -1)
        h = torch.tanh(q) * torch.sigmoid(k) + v * x
        return h, h.sum(-1)

    def f(c, xs):
        final, ys = scan(body, c, xs, remat="min_cut")
        return (final, ys), torch.autograd.grad(final.pow(2).sum() + ys.sum(), (c, xs, W3))

    def want(c, xs):
        final, ys = reference_scan(body, c, xs)
        return (final, ys), torch.autograd.grad(final.pow(2).sum() + ys.sum(), (c, xs, W3))

    def example(b, n):
        return (torch.randn(b, 4, dtype=torch.float64, requires_grad=True),
                torch.randn(n, b, 4, dtype=torch.float64, requires_grad=True))

    gm = make_fx(f, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*example(3, 5))
    for b, n in ((3, 5), (2, 7)):
        args = example(b, n)
        assert_trees_close(gm(*args), want(*args))


@pytest.mark.parametrize("where", ["compile", "xla"])
@pytest.mark.parametrize("chain", [0, 1, 2])
def test_a_carry_reached_by_the_weight_steps_later_gets_the_loops_gradients(where, chain):
    """Carry i depends on the weight only through carry i-1: it requires grad from step i+1 on.
    The joint is first traced at the flags one step gives (trace.joint.flags_and_joint); with
    chain >= 1 that guess is short of the fixed point and the joint is traced again there."""
    if where == "xla":
        torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA case needs the [xla] extra")
        device = torch_xla.device()
    gen = torch.Generator().manual_seed(chain)
    w0 = torch.randn(3, generator=gen, dtype=torch.float64)
    xs0 = torch.randn(4, 3, generator=gen, dtype=torch.float64)

    def run(device, scan_fn):
        w = w0.to(device).requires_grad_()

        def body(c, x):
            new = [c[0] * w + x] + [c[i] + c[i - 1] for i in range(1, chain + 1)]
            return new, new[-1].sum()

        init = [torch.zeros(3, dtype=torch.float64, device=device) for _ in range(chain + 1)]
        c, ys = scan_fn(body, init, xs0.to(device))
        loss = ys.pow(2).sum() + sum(t.sin().sum() for t in c)
        return [t.detach().cpu() for t in (*c, ys, *torch.autograd.grad(loss, [w]))]

    got = run("cpu", torch.compile(scan, backend="aot_eager")) if where == "compile" else run(device, scan)
    assert_trees_close(got, run("cpu", reference_scan), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("tracing_mode", ["real", "symbolic"])
def test_traced_graph_runs_when_the_new_carry_changes_layout(tracing_mode):
    """``tanh(c.reshape(3, 2).t() * b)`` returns the transpose's strides; the body
    graph was traced on a contiguous carry, where its reshape became a view. Run
    eagerly, the graph's scan node gets each new carry in init's layout: values
    and gradients of the loop (the view failed on the second step)."""
    def body(c, x):
        return torch.tanh(c.reshape(3, 2).t() * x), c.sum()

    def f(c, xs):
        return scan(body, c, xs)

    c, xs = torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 2, 3, dtype=torch.float64)
    gm = make_fx(f, tracing_mode=tracing_mode)(c, xs)
    _assert_values_and_grads_of_the_loop(gm, lambda c, xs: reference_scan(body, c, xs), c, xs)


def _assert_values_and_grads_of_the_loop(run, loop, *inputs):
    """``run(*inputs)`` and ``loop(*inputs)``, each on its own copies requiring grad: the same
    (carry, ys), and the same gradients of the inputs."""
    got_in = [t.clone().requires_grad_() for t in inputs]
    want_in = [t.clone().requires_grad_() for t in inputs]
    got, want = run(*got_in), loop(*want_in)
    assert_trees_close(got, want, atol=1e-12, rtol=1e-12)
    loss = lambda out: out[0].sin().sum() + out[1].sum()  # noqa: E731
    assert_trees_close(torch.autograd.grad(loss(got), got_in), torch.autograd.grad(loss(want), want_in),
                       atol=1e-12, rtol=1e-12)


def test_a_body_that_solves_partitions_and_trains_as_the_loop(fresh_dynamo):
    """``linalg.solve`` records ``aten._linalg_check_errors`` (no value) in the step's joint;
    torch 2.11's default partitioner asserted on it ("Expected _linalg_check_errors to be a
    tensor"): every save_all scan of a Kalman-style body failed to compile there."""
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    eye = torch.eye(3, dtype=torch.float64)
    body = lambda c, x: (torch.linalg.solve(w @ w.T + eye, c) + x, c.sum())  # noqa: E731
    c0, xs = torch.randn(3, 2, dtype=torch.float64, requires_grad=True), torch.randn(4, 3, 2, dtype=torch.float64)
    compiled = torch.compile(lambda c0, xs: scan(body, c0, xs), backend="aot_eager", fullgraph=True)
    got, want = compiled(c0, xs), reference_scan(body, c0, xs)
    torch.testing.assert_close(got, want)
    grads = [torch.autograd.grad(c.sum() + ys.square().sum(), [w, c0]) for c, ys in (got, want)]
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("where", ["make_fx", "aot_eager", "inductor"])
def test_traced_graph_runs_on_an_init_that_is_not_dense(where, fresh_dynamo):
    """init a slice of a wider tensor (strides (10, 3, 1)): ``example_args`` cloned it
    dense, so the body's ``c.reshape(4, 3)`` was traced as a view that init's own layout
    does not allow ("view size is not compatible" at step 0; inductor: "Cannot view a
    tensor with shape ... and strides (10, 3, 1)"). init is copied into the traced layout
    first, as every later carry is: values and gradients of the loop."""
    w = torch.randn(3, 3, dtype=torch.float64)

    def body(c, x):
        return torch.tanh(c.reshape(4, 3) @ w).reshape(2, 2, 3) + x, c.sum()

    def f(run, base, xs):
        return run(body, base[:, :6].unflatten(1, (2, 3)), xs)

    base, xs = torch.randn(2, 10, dtype=torch.float64), torch.randn(3, 2, 2, 3, dtype=torch.float64)
    if where == "make_fx":
        run = make_fx(lambda base, xs: f(scan, base, xs))(base, xs)
    else:
        run = torch.compile(lambda base, xs: f(scan, base, xs), backend=where, fullgraph=True)
    _assert_values_and_grads_of_the_loop(run, lambda base, xs: f(reference_scan, base, xs), base, xs)


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
@pytest.mark.parametrize("traced", ["forward", "forward_and_backward"])
def test_make_fx_of_upstreams_front_end_on_inputs_that_require_grad(tracing_mode, traced, fresh_dynamo):
    """Upstream's ``torch._higher_order_ops.scan.scan`` compiles itself with Dynamo, whose fake
    run of our node uses Dynamo's own fake tensors while the outer make_fx is still on: the
    autograd rule's body trace re-entered the outer tracer on them ("Mixing fake modes NYI";
    torch 2.9's own scan op traces it, pytorch's test_scan_simple_graph on inputs that
    require grad). The traced graph: the loop's values and gradients."""
    from torch._higher_order_ops.scan import scan as upstream_scan

    def body(c, x):
        return torch.tanh(c * x), c + x

    def loss(out):
        return out[0].sin().sum() + out[1].sum()

    def run(scan_fn):
        if traced == "forward":
            return lambda c, xs: scan_fn(body, c, xs, reverse=True)
        return lambda c, xs: torch.autograd.grad(loss(scan_fn(body, c, xs, reverse=True)), (c, xs))

    c = torch.randn(1, 3, 2, dtype=torch.float64, requires_grad=True)  # torch 2.14+: a size-1 dim
    xs = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)  # takes the joint trace there
    gm = make_fx(run(upstream_scan), tracing_mode=tracing_mode)(c, xs)
    loop = run(lambda fn, c, xs, reverse: reference_scan(fn, c, xs, reverse=reverse))
    if traced == "forward":
        _assert_values_and_grads_of_the_loop(gm, loop, c.detach(), xs.detach())
    else:
        assert_trees_close(gm(c, xs), loop(c, xs), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_schema_of_a_call_under_make_fx_records_no_stand_ins(mode):
    """``scan_op.gen_schema`` traces the body on stand-ins (``core.op_args.example_args``);
    asked for under a make_fx trace, those stand-ins (clones of init, zeros for a slice)
    were once recorded in the caller's graph."""
    def f(c, xs):
        schema = scan_op.gen_schema(lambda c, x: [c + x, c * x], [c], [xs], ())
        assert [a.name for a in schema.arguments] == ["combine_fn", "init0", "xs0"]
        return c + 1

    gm = make_fx(f, tracing_mode=mode)(torch.randn(3), torch.randn(4, 3))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.ops.aten.add.Tensor], gm.code
