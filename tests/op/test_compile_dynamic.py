"""torch.compile with dynamic shapes: one compile for every length, training included."""
import pytest
import torch
from conftest import assert_trees_close
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import scan


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("how", ["mark_dynamic", "dynamic=True"])
def test_dynamic_length_compiles_once(how):
    w = torch.randn(4, 4)

    def f(c, xs):
        return scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c, xs)

    cf = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True if how == "dynamic=True" else None)
    for n in (3, 5, 8):
        xs = torch.randn(n, 2, 4)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(xs, 0)
        assert_trees_close(cf(torch.zeros(2, 4), xs), f(torch.zeros(2, 4), xs))
    assert counters["stats"]["unique_graphs"] == 1


def test_mark_dynamic_length_training_compiles_once():
    w = torch.randn(4, 4, requires_grad=True)

    def loss(c, xs):
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c, xs)
        return c.sum() + ys.sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    for n in (3, 5, 8):
        xs = torch.randn(n, 2, 4)
        torch._dynamo.mark_dynamic(xs, 0)
        (got,) = torch.autograd.grad(compiled(torch.zeros(2, 4), xs), w)
        (want,) = torch.autograd.grad(loss(torch.zeros(2, 4), xs), w)
        torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] == 1


def test_dynamic_true_training_matches_eager_and_compiles_once():
    """Symbolic per-step shapes: the backward's saved sizes are evaluated once, not stacked."""
    w = torch.randn(4, 4, requires_grad=True)

    def loss(c, xs):
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c, xs, reverse=True)
        return c.pow(2).sum() + ys.sum()

    compiled = torch.compile(loss, backend="aot_eager", dynamic=True)
    for n, batch in ((3, 2), (5, 3), (8, 2)):
        c0 = torch.randn(batch, 4, requires_grad=True)
        xs = torch.randn(n, batch, 4)
        got = torch.autograd.grad(compiled(c0, xs), (w, c0))
        want = torch.autograd.grad(loss(c0, xs), (w, c0))
        assert_trees_close(list(got), list(want), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def scan_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]


def test_carry_check_does_not_lift_init_into_the_body():
    """Under dynamic=True the body's carry check compared against the outer init tensors, so Dynamo
    lifted init into the op's additional inputs: a closure requiring grad whose zero gradient the
    backward summed every step. Only closures and size symbols may be lifted."""
    graphs = []
    w = torch.randn(3, 3)
    c0 = torch.randn(2, 3, requires_grad=True)

    def f(c0, xs):
        return scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c0, xs)

    torch.compile(f, backend=lambda gm, _: graphs.append(gm) or gm.forward, dynamic=True)(c0, torch.randn(5, 2, 3))
    (node,) = scan_nodes(graphs[0])
    lifted_tensors = [a.meta["example_value"] for a in node.args[3]
                      if isinstance(a.meta.get("example_value"), torch.Tensor)]
    assert [t.shape for t in lifted_tensors] == [w.shape]  # w only: no init


def test_dynamic_true_training_of_a_body_whose_backward_reads_a_size_symbol():
    """``c.sum()`` broadcast back over c: the backward needs c's batch size, a symbol Dynamo lifts."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    cell = lambda c, x: (torch.tanh(lin(c) + c.sum()), c)  # noqa: E731

    def loss(c0, xs):
        c, ys = scan(cell, c0, xs)
        return c.sum() + ys.pow(2).sum()

    compiled = torch.compile(loss, backend="aot_eager", dynamic=True)
    for n, batch in ((5, 2), (7, 4)):
        c0, xs = torch.randn(batch, 3, requires_grad=True), torch.randn(n, batch, 3)
        got = torch.autograd.grad(compiled(c0, xs), [c0, *lin.parameters()])
        want = torch.autograd.grad(loss(c0, xs), [c0, *lin.parameters()])
        assert_trees_close(list(got), list(want), atol=1e-5, rtol=1e-5)


def test_symbolic_make_fx_of_a_training_step_runs_other_lengths():
    w = torch.randn(4, 4, requires_grad=True)

    def step(c0, xs):
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c0, xs)
        return torch.autograd.grad(c.pow(2).sum() + ys.pow(2).sum(), [w, c0])

    c0 = torch.randn(2, 4, requires_grad=True)
    gm = make_fx(step, tracing_mode="symbolic", _allow_non_fake_inputs=True)(c0, torch.randn(5, 2, 4))
    for n in (5, 7):
        xs = torch.randn(n, 2, 4)
        assert_trees_close(list(gm(c0, xs)), list(step(c0, xs)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
def test_dynamic_length_argument_of_zero_then_others(reverse):
    """``xs=None`` and ``length`` an argument of a ``dynamic=True`` compile: a length of 0 (then a
    symbolic size whose example is 0) gives init and empty ys, and other lengths after it their
    loop's values. torch 2.15 failed the first call in inductor: the loop's step was traced,
    and its ``select`` at index L-1 failed the bounds check for an example L of 0."""
    from conftest import reference_scan

    def body(c, _):
        return torch.tanh(c * 1.5 + 0.1), c.sum(-1)

    f = torch.compile(lambda c, n: scan(body, c, None, length=n, reverse=reverse), backend="inductor",
                      dynamic=True, fullgraph=True)
    c0 = torch.randn(2, 3)
    for n in (0, 3, 0, 5):
        got = f(c0, n)
        want = reference_scan(body, c0, None, length=n, reverse=reverse)  # its ys: None at length 0
        assert_trees_close(got if n else got[0], want if n else want[0])
        assert got[1].shape == (n, 2)


@pytest.mark.parametrize("train", [False, True])
def test_inductor_xs_whose_length_is_an_expression_of_another_size(train):
    """xs made in the graph (``cat([a, a])``: length 2*s): inductor preallocates the ys from
    the loop's inputs, none of which has the size s alone; the length is resolved as a whole
    (a KeyError on s inside inductor on torch 2.9 and 2.15 before). Values and gradients
    against eager, one graph for every length."""
    w = torch.randn(4, 4, requires_grad=train)

    def f(c, a):
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), (c * x).sum(-1)), c, torch.cat([a, a]))
        return c, ys

    cf = torch.compile(f, backend="inductor", dynamic=True, fullgraph=True)
    for n in (3, 5, 8):
        c, a = torch.randn(2, 4), torch.randn(n, 2, 4, requires_grad=train)
        got, want = cf(c, a), f(c, a)
        assert_trees_close(got, want)
        if train:
            grads = [torch.autograd.grad(sum(t.sum() for t in out), (w, a)) for out in (got, want)]
            # w's gradient sums 2n steps through tanh: float32 roundings (the compiled tanh is not
            # eager's Sleef) add up to ~1e-6 of its largest element (|26|: 3e-5 on an AMD EPYC)
            assert_trees_close(*grads, rtol=1e-5, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
