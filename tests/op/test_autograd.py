"""Gradients: gradcheck in float64, the Python-loop reference, remat policies, fwd_bwd graphs."""
import itertools

import expecttest
import pytest
import torch
from conftest import assert_trees_close, reference_scan

import torch_scan_hop
from torch_scan_hop import ScanError, fwd_bwd, scan

D = torch.float64
REMATS = ["save_all", "min_cut", "recompute_all"]


def make_body(w, h):
    def body(c, x):
        a = torch.cos(torch.sin(c["h"]) @ w + x["u"]) @ h
        new = {"h": torch.sigmoid(a) * x["v"], "k": c["k"] + 1}
        return new, {"s": a.sum(-1), "k": c["k"] * 2}
    return body


def inputs(n=4, init_grad=True, xs_grad=True):
    init = {"h": torch.randn(2, 3, dtype=D, requires_grad=init_grad), "k": torch.tensor(0)}
    xs = {"u": torch.randn(n, 2, 3, dtype=D, requires_grad=xs_grad), "v": torch.rand(n, 1, 3, dtype=D)}
    return init, xs


def loss_of(out):
    carry, ys = out
    return carry["h"].pow(2).sum() + ys["s"].sin().sum()


@pytest.mark.parametrize("remat", ["save_all", "recompute_all"])  # min_cut: slow partitioner, see below
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("init_grad,xs_grad,w_grad", [
    (a, b, c) for a, b, c in itertools.product([True, False], repeat=3) if a or b or c])
def test_grads_match_loop_every_requires_grad_mix(remat, reverse, init_grad, xs_grad, w_grad):
    w = torch.randn(3, 3, dtype=D, requires_grad=w_grad)
    h = torch.randn(3, 3, dtype=D, requires_grad=w_grad)
    init, xs = inputs(init_grad=init_grad, xs_grad=xs_grad)
    body = make_body(w, h)
    wrt = [t for t in (init["h"], xs["u"], w, h) if t.requires_grad]
    got = torch.autograd.grad(loss_of(scan(body, init, xs, reverse=reverse, remat=remat)), wrt)
    want = torch.autograd.grad(loss_of(reference_scan(body, init, xs, reverse=reverse)), wrt)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("remat,reverse,dim", [
    ("save_all", False, 0), ("save_all", True, 1), ("recompute_all", True, 0), ("recompute_all", False, 2),
    ("min_cut", True, 0)])
def test_gradcheck(remat, reverse, dim):
    w = torch.randn(3, 3, dtype=D, requires_grad=True)

    def f(c, xs, w):
        def body(c, x):
            c = torch.tanh(c @ w + x[..., :3] * x[..., 3:])
            return c, (c * c).sum(-1)
        return scan(body, c, xs, reverse=reverse, dim=dim, remat=remat)

    c = torch.randn(2, 3, dtype=D, requires_grad=True)
    xs = torch.randn(3, 2, 6, dtype=D, requires_grad=True).movedim(0, dim).detach().requires_grad_()
    assert torch.autograd.gradcheck(f, (c, xs, w))


def test_gradcheck_module_parameters():
    cell = torch.nn.GRUCell(3, 3).double()

    def f(h, xs, *params):
        return scan(lambda h, x: (cell(x, h), h.sum(-1)), h, xs)

    h, xs = torch.randn(2, 3, dtype=D, requires_grad=True), torch.randn(4, 2, 3, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(f, (h, xs, *cell.parameters()))
    scan(lambda h, x: (cell(x, h), None), h.detach(), xs.detach())[0].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in cell.parameters())


def test_init_without_grad_xs_with_grad_pytorch_184528():
    init = torch.zeros(3, dtype=D)  # does not require grad
    xs = torch.randn(5, 3, dtype=D, requires_grad=True)
    body = lambda c, x: (c * 0.5 + x.sin(), c.clone())  # noqa: E731
    got = torch.autograd.grad(scan(body, init, xs)[1].sum(), xs)[0]
    want = torch.autograd.grad(reference_scan(body, init, xs)[1].sum(), xs)[0]
    torch.testing.assert_close(got, want)


def test_unused_outputs_and_integer_only_ys():
    w = torch.randn(3, dtype=D, requires_grad=True)
    xs = torch.randn(4, 3, dtype=D)
    body = lambda c, x: (c * w + x, (c > 0).long())  # noqa: E731
    carry, ys = scan(body, torch.ones(3, dtype=D), xs)
    assert ys.dtype == torch.long and not ys.requires_grad
    (g,) = torch.autograd.grad(carry.sum(), w)
    (r,) = torch.autograd.grad(reference_scan(body, torch.ones(3, dtype=D), xs)[0].sum(), w)
    torch.testing.assert_close(g, r)


def test_zero_length_grad():
    w = torch.randn(3, requires_grad=True)
    carry, ys = scan(lambda c, x: (c * w, c), torch.ones(3), torch.zeros(0, 3))
    assert ys.shape == (0, 3)
    assert torch.equal(carry, torch.ones(3))


@pytest.mark.parametrize("remat", REMATS)
def test_double_backward_matches_loop(remat):
    w = torch.randn(3, dtype=D, requires_grad=True)
    init, xs = torch.ones(3, dtype=D), torch.randn(4, 3, dtype=D)
    body = lambda c, x: (torch.sin(c * w + x), None)  # noqa: E731

    def hessian_diag(run):
        (g,) = torch.autograd.grad(run()[0].sum(), w, create_graph=True)
        return torch.autograd.grad(g.sum(), w)[0]

    want = hessian_diag(lambda: reference_scan(body, init, xs))
    torch.testing.assert_close(hessian_diag(lambda: scan(body, init, xs, remat=remat)), want)


def test_custom_partition_function_is_called():
    from functorch.compile import default_partition

    calls = []

    def partition(joint, inputs, *, num_fwd_outputs):
        calls.append(num_fwd_outputs)
        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs)

    w = torch.randn(3, dtype=D, requires_grad=True)
    c, _ = scan(lambda c, x: (torch.sin(c * w + x), None), torch.ones(3, dtype=D), torch.randn(4, 3, dtype=D),
                remat=partition)
    c.sum().backward()
    assert calls == [1] and w.grad is not None


def test_x_slices_are_not_saved_twice():
    w = torch.randn(4, 4, requires_grad=True)
    fb = fwd_bwd(lambda c, x: (c @ w * x, None), torch.randn(2, 4), torch.randn(2, 4))
    kinds = [k for k, _ in fb.saved_from]
    assert ("x", 0) in fb.saved_from and ("lifted", 0) in fb.saved_from, fb.saved_from
    assert kinds.count("step") == 1  # only the per-step c @ w


def test_views_of_x_slices_are_recomputed_not_saved():
    """A weight scanned as x (scan_layers): the backward needs t(W[i]); saving it
    would stack a copy of every weight per step, re-slicing W costs nothing."""
    body = lambda c, w: (torch.tanh(c @ w.t() + w.sum()), None)  # noqa: E731
    fb = fwd_bwd(body, torch.randn(2, 4), torch.randn(4, 4))
    assert [k for k, _ in fb.saved_from].count("step") == 1, fb.saved_from  # tanh's output only
    assert ("x", 0) in fb.saved_from
    w = torch.randn(5, 4, 4, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c0, w: scan(body, c0, w)[0], (c0, w))



def _permuted_body(w):
    """``tanh`` of a value laid out as the transpose of its memory: its saved output is a
    dense permutation, and the backward reshapes it (a copy unless it is a view)."""
    def body(c, x):
        a = torch.tanh((c @ w + x).mT.contiguous().mT * 0.5)  # (4, 3) values over (3, 4) memory
        return a.mT.reshape(3, 4).mT.contiguous() + c, a.reshape(12).sum()
    return body


def test_permuted_saved_values_are_saved_contiguous_and_permuted_back():
    w = torch.randn(3, 3, requires_grad=True)
    fb = fwd_bwd(_permuted_body(w), torch.randn(4, 3), torch.randn(4, 3))
    saved = list(fb.fwd.graph.find_nodes(op="output")[0].args[0])[fb.num_carry + fb.num_y:]
    step_saved = [n for n, (kind, _) in zip(saved, fb.saved_from) if kind == "step"]
    assert step_saved and all(n.meta["val"].is_contiguous() for n in step_saved), \
        [(n.name, n.meta["val"].stride()) for n in step_saved]
    assert any(n.target is torch.ops.aten.permute.default for n in step_saved)


def _permuted_problem(reverse=False):
    """(body, init, xs, grads): ``grads(run)`` is the gradients of a loss of ``run``'s scan
    (ours or the reference loop) of ``_permuted_body`` with respect to init, xs and its weight."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    init, xs = torch.randn(4, 3, dtype=D, requires_grad=True), torch.randn(5, 4, 3, dtype=D, requires_grad=True)
    body = _permuted_body(w)

    def grads(run):
        def f(init, xs):
            c, ys = run(body, init, xs, reverse=reverse)
            return torch.autograd.grad(c.pow(2).sum() + ys.sin().sum(), [init, xs, w])
        return f
    return body, init, xs, grads


@pytest.mark.parametrize("mode", ["eager", "make_fx", "aot_eager", "inductor"])
@pytest.mark.parametrize("reverse", [False, True])
def test_permuted_saved_values_match_the_loop(mode, reverse):
    body, init, xs, grads = _permuted_problem(reverse)
    if mode in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(lambda i, x: scan(body, i, x, reverse=reverse), backend=mode)
        got = grads(lambda fn, i, x, reverse: compiled(i, x))(init, xs)
    else:
        got = _modes()[mode](grads(scan), init, xs)
    for g, want in zip(got, grads(reference_scan)(init, xs)):
        torch.testing.assert_close(g, want)
    if mode == "eager":
        assert torch.autograd.gradcheck(lambda i, x: scan(body, i, x, reverse=reverse)[0], (init, xs))


def test_a_compiled_scan_under_anomaly_mode_matches_the_loop():
    # the joint's backward was traced with anomaly mode's NaN check on: a data-dependent read of
    # a fake value, which failed every traced scan (a ScanError blaming the body; on XLA an
    # AttributeError); now the joint is traced without it. (make_fx of a whole training step
    # under anomaly mode fails in torch itself, on the loop too: its own backward is traced.)
    _, init, xs, grads = _permuted_problem()
    with torch.autograd.set_detect_anomaly(True):
        got = _modes()["aot_eager"](grads(scan), init, xs)
    torch.testing.assert_close(got, grads(reference_scan)(init, xs))


def seed_body():
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    h = torch.randn(4, 4, requires_grad=True)

    def body(c, x):
        c = torch.sigmoid(torch.cos(torch.sin(c) @ w + x) @ h)
        return c, c.sum(-1)

    return body, (w, h)


class TestFwdBwdGraphs(expecttest.TestCase):
    def test_seed_body_save_all(self):
        body, (w, h) = seed_body()
        fb = fwd_bwd(body, torch.randn(2, 4), torch.randn(2, 4))
        self.assertEqual([t is w for t in fb.lifted], [True, False])
        self.assertExpectedInline(fb.fwd.code.strip(), """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    sin = torch.ops.aten.sin.default(primals_1)
    mm = torch.ops.aten.mm.default(sin, primals_3)
    add = torch.ops.aten.add.Tensor(mm, primals_2);  mm = primals_2 = None
    cos = torch.ops.aten.cos.default(add)
    mm_1 = torch.ops.aten.mm.default(cos, primals_4)
    sigmoid = torch.ops.aten.sigmoid.default(mm_1);  mm_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(sigmoid, [-1])
    return (sigmoid, sum_1, primals_1, primals_3, primals_4, sin, add, cos, sigmoid)""")
        self.assertExpectedInline(fb.bwd.code.strip(), """\
def forward(self, primals_1, primals_3, primals_4, sin, add, cos, sigmoid, tangents_1, tangents_2):
    unsqueeze = torch.ops.aten.unsqueeze.default(tangents_2, -1);  tangents_2 = None
    expand = torch.ops.aten.expand.default(unsqueeze, [2, 4]);  unsqueeze = None
    add_1 = torch.ops.aten.add.Tensor(tangents_1, expand);  tangents_1 = expand = None
    sigmoid_backward = torch.ops.aten.sigmoid_backward.default(add_1, sigmoid);  add_1 = sigmoid = None
    t = torch.ops.aten.t.default(cos);  cos = None
    mm_2 = torch.ops.aten.mm.default(t, sigmoid_backward);  t = None
    t_1 = torch.ops.aten.t.default(primals_4);  primals_4 = None
    mm_3 = torch.ops.aten.mm.default(sigmoid_backward, t_1);  sigmoid_backward = t_1 = None
    sin_1 = torch.ops.aten.sin.default(add);  add = None
    neg = torch.ops.aten.neg.default(sin_1);  sin_1 = None
    mul = torch.ops.aten.mul.Tensor(mm_3, neg);  mm_3 = neg = None
    t_2 = torch.ops.aten.t.default(sin);  sin = None
    mm_4 = torch.ops.aten.mm.default(t_2, mul);  t_2 = None
    t_3 = torch.ops.aten.t.default(primals_3);  primals_3 = None
    mm_5 = torch.ops.aten.mm.default(mul, t_3);  t_3 = None
    cos_1 = torch.ops.aten.cos.default(primals_1);  primals_1 = None
    mul_1 = torch.ops.aten.mul.Tensor(mm_5, cos_1);  mm_5 = cos_1 = None
    return (mul_1, mul, mm_4, mm_2)""")

    def test_seed_body_recompute_all(self):
        body, _ = seed_body()
        fb = fwd_bwd(body, torch.randn(2, 4), torch.randn(2, 4), remat="recompute_all")
        self.assertExpectedInline(str(fb.saved_from), """[('carry', 0), ('x', 0), ('lifted', 0), ('lifted', 1)]""")
        self.assertExpectedInline(fb.fwd.code.strip(), """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    sin = torch.ops.aten.sin.default(primals_1)
    mm = torch.ops.aten.mm.default(sin, primals_3);  sin = None
    add = torch.ops.aten.add.Tensor(mm, primals_2);  mm = None
    cos = torch.ops.aten.cos.default(add);  add = None
    mm_1 = torch.ops.aten.mm.default(cos, primals_4);  cos = None
    sigmoid = torch.ops.aten.sigmoid.default(mm_1);  mm_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(sigmoid, [-1])
    return (sigmoid, sum_1, primals_1, primals_2, primals_3, primals_4)""")


def test_fwd_bwd_graphs_compute_the_step_and_its_vjp():
    body, (w, h) = seed_body()
    c, x = torch.randn(2, 4, dtype=torch.float32), torch.randn(2, 4)
    fb = fwd_bwd(body, c, x)
    new_c, y, *saved = fb.fwd(c, x, *fb.lifted)
    ref_c, ref_y = body(c, x)
    torch.testing.assert_close(new_c, ref_c)
    gc, gy = torch.randn_like(new_c), torch.randn_like(y)
    grads = fb.bwd(*saved, gc, gy)
    cc, xx = c.clone().requires_grad_(), x.clone().requires_grad_()
    want = torch.autograd.grad(body(cc, xx), [cc, xx, w, h], [gc, gy])
    for g, r in zip(grads, want):
        torch.testing.assert_close(g, r)
    assert torch_scan_hop.FwdBwd is type(fb)


def test_make_fx_of_a_training_step_has_forward_and_backward_scans():
    from torch.fx.experimental.proxy_tensor import make_fx

    def train(c, xs, w):
        def cell(c, x):
            c = torch.tanh(c @ w + x)
            return c, c.sum(-1)

        carry, ys = scan(cell, c, xs)
        return torch.autograd.grad(carry.sum() + ys.sum(), [w])

    args = (torch.zeros(2, 4), torch.randn(6, 2, 4), torch.randn(4, 4, requires_grad=True))
    gm = make_fx(train, tracing_mode="fake")(*args)
    scans = [n for n in gm.graph.nodes if n.target is torch_scan_hop.scan_op]
    assert len(scans) == 2  # the forward scan and the backward (reverse) scan
    torch.testing.assert_close(gm(*args)[0], train(*args)[0])


def _modes():
    from torch.fx.experimental.proxy_tensor import make_fx

    def eager(f, *args):
        return f(*args)

    def traced(f, *args):
        return make_fx(f)(*args)(*args)

    def compiled(f, *args):
        torch._dynamo.reset()
        return torch.compile(f, backend="aot_eager")(*args)

    return {"eager": eager, "make_fx": traced, "aot_eager": compiled}


BIAS = torch.randn(3, dtype=D, requires_grad=True)
W2 = torch.randn(3, 3, dtype=D, requires_grad=True)


@pytest.mark.parametrize("mode", ["eager", "make_fx", "aot_eager"])
@pytest.mark.parametrize("body", [
    pytest.param(lambda c, x: (c * 2 + x + BIAS, None), id="no_saved_value"),
    pytest.param(lambda c, x: (torch.tanh(torch.tanh(c @ W2 + x) @ W2), c.sum()), id="closure_read_twice"),
    pytest.param(lambda c, x: (c @ W2.detach() + x, x * 2), id="frozen_weight_and_x_only_y"),
])
def test_bodies_that_broke_traced_paths(mode, body):
    init, xs = torch.randn(3, dtype=D, requires_grad=True), torch.randn(4, 3, dtype=D, requires_grad=True)

    def grads(run):
        def f(init, xs):
            c, ys = run(body, init, xs)
            loss = c.pow(2).sum() + (0 if ys is None else ys.sin().sum())
            return torch.autograd.grad(loss, [init, xs, BIAS, W2], allow_unused=True, materialize_grads=True)
        return f

    if mode == "aot_eager":  # autograd.grad graph-breaks; the scan is compiled, the grads are taken outside
        compiled = torch.compile(lambda i, x: scan(body, i, x), backend="aot_eager")
        got = grads(lambda fn, i, x: compiled(i, x))(init, xs)
    else:
        got = _modes()[mode](grads(scan), init, xs)
    for g, w in zip(got, grads(reference_scan)(init, xs)):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("remat", REMATS)
@pytest.mark.parametrize("tracing_mode", ["real", "symbolic"])
def test_make_fx_graph_run_under_autograd_keeps_the_bodys_detach(tracing_mode, remat):
    """Running a make_fx graph of a scan with inputs that require grad differentiates
    the recorded forward body: a ``.detach()`` in the body must still stop gradient
    there (the forward graph once dropped it, and gradient flowed as the loop's never does)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(3, dtype=D, requires_grad=True)

    def body(c, x):
        h = torch.tanh(c * w + x)
        return h, (h.detach() * c * x).sum(-1)

    def grads(run, init, xs):
        c, ys = run(init, xs)
        return torch.autograd.grad(c.pow(2).sum() + ys.sin().sum(), [init, xs, w])

    init, xs = torch.randn(2, 3, dtype=D, requires_grad=True), torch.randn(5, 2, 3, dtype=D, requires_grad=True)
    # an explicit table: torch 2.14's default make_fx records detach as alias, documented as "re-differentiating
    # the returned graph does not preserve those detach calls", for a loop as for a scan
    gm = make_fx(lambda i, x: scan(body, i, x, remat=remat), decomposition_table={}, tracing_mode=tracing_mode,
                 _allow_non_fake_inputs=True)(init, xs)
    for n in (5, 3) if tracing_mode == "symbolic" else (5,):
        xs_n = xs[:n].detach().requires_grad_()
        assert_trees_close(grads(gm, init, xs_n), grads(lambda i, x: reference_scan(body, i, x), init, xs_n))


def _partition_fn():
    from functorch.compile import default_partition

    return default_partition


def _delayed(w):  # gradient reaches carry a one step after b, the y one more step later
    return (torch.ones(3, dtype=D), torch.ones(3, dtype=D), torch.tensor(0)), \
        lambda c, x: ((torch.tanh(c[1]), c[1] * w, c[2] + 1), c[0].sum())


def _swapped(w):  # init's a requires grad and b not; the body swaps them: the flags alternate
    return (torch.ones(3, dtype=D, requires_grad=True), torch.ones(3, dtype=D)), \
        lambda c, x: ((c[1] * 1.5, torch.sin(c[0])), c[1].sum())


def _overwritten(w):  # init requires grad, the body overwrites the carry with a constant
    return (torch.ones(3, dtype=D, requires_grad=True),), \
        lambda c, x: ((torch.full((3,), 0.5, dtype=D),), c[0].sum() * 2)


@pytest.mark.parametrize("make", [_delayed, _swapped, _overwritten], ids=["delayed", "swapped", "overwritten"])
@pytest.mark.parametrize("mode,remat", [("eager", "save_all"), ("eager", "partition_fn"), ("aot_eager", "save_all")])
@pytest.mark.parametrize("length", [0, 1, 2, 3, 4])
def test_outputs_require_grad_as_after_that_many_loop_steps(length, remat, mode, make):
    """requires_grad of every output is the loop's after that many steps: a carry may not
    require grad yet, or not any more. The traced rule (a partition function in eager, or
    any compiler) once flagged every output by the carries' steady state."""
    w = torch.randn(3, dtype=D, requires_grad=True)
    init, body = make(w)
    kw = dict(length=length, remat=_partition_fn() if remat == "partition_fn" else remat)
    if mode == "aot_eager":
        torch._dynamo.reset()
        carry, ys = torch.compile(lambda i: scan(body, i, None, **kw), backend="aot_eager", dynamic=False)(init)
    else:
        carry, ys = scan(body, init, None, **kw)
    want_carry, want_ys = reference_scan(body, init, None, length=length)
    assert [t.requires_grad for t in carry] == [t.requires_grad for t in want_carry]
    if length:
        assert ys.requires_grad == want_ys.requires_grad
        assert_trees_close((carry, ys), (want_carry, want_ys))


def _written_buffer_body(w):
    """A carried buffer written and read at the step index (``buf[:, t]``), its row through
    an attention: a body whose backward reads a symbolic size (the buffer's width), where
    torch 2.9 keeps the attention (a seeded op) and everything before it in any graph."""
    def body(state, x, t):
        c, buf = state
        buf[:, t] = buf[:, t] + c
        r = buf.select(1, (t - 1) % buf.shape[1]).clone() * w
        q = r.reshape(1, 1, 1, 3)
        r = torch.nn.functional.scaled_dot_product_attention(q, q, q)[0, 0, 0]
        h = torch.tanh(c * r + x)
        return (h, buf), (h * r).sum()
    return body


@pytest.mark.parametrize("remat", ["save_all", "partition_fn"])
@pytest.mark.parametrize("tracing_mode", ["symbolic", "fake"])
def test_make_fx_graph_holds_no_stand_ins_of_the_step(tracing_mode, remat):
    """The backward's symbolic sizes come from the inputs' sizes: no stand-in of one step
    (``new_empty``) is in the traced graph. The sizes were once computed by running the
    forward step on stand-ins under the trace, so its ops were recorded on uninitialized
    tensors, and the graph indexed a buffer by an uninitialized step index (an IndexError
    or a read anywhere, by what memory held)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    kw = dict(remat=_partition_fn() if remat == "partition_fn" else remat)

    def f(c0, b0, xs, w):
        (c, b), ys = scan(_written_buffer_body(w), (c0, b0.clone()), xs, with_index=True, **kw)
        return c, b, ys, torch.autograd.grad(c.sum() + ys.sum() + b.sum(), [c0, b0, xs, w])

    def loop(c0, b0, xs, w):
        body = _written_buffer_body(w)
        (c, b), ys = reference_scan(lambda s, xt: body(s, *xt), (c0, b0.clone()), (xs, torch.arange(xs.shape[0])))
        return c, b, ys, torch.autograd.grad(c.sum() + ys.sum() + b.sum(), [c0, b0, xs, w])

    def inputs(n):
        return (torch.randn(3, dtype=D, requires_grad=True), torch.randn(3, n, dtype=D, requires_grad=True),
                torch.randn(n, 3, dtype=D, requires_grad=True), torch.randn(3, dtype=D, requires_grad=True))

    gm = make_fx(f, tracing_mode=tracing_mode, decomposition_table={})(*inputs(4))
    stand_ins = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.new_empty.default,
                                                           torch.ops.aten.empty_like.default)]
    assert not stand_ins, gm.code
    for n in (4, 6) if tracing_mode == "symbolic" else (4,):
        args = inputs(n)
        assert_trees_close(gm(*args), loop(*args))
