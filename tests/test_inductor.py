"""Inductor against the Python loop: the torch 2.9 inductor defects the scan's loops must survive."""
import pytest
import torch
from conftest import assert_trees_close
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rnn_cell(w, b):
    def cell(c, x):
        h = torch.tanh(c @ w + x + b)
        return h, h * x
    return cell


def test_loop_bodies_never_write_into_their_inputs():
    """torch 2.9 lowered a while_loop body of a backward graph with the backward's donated-input
    indices applied to the body's own inputs (fixed upstream by pytorch#193960): the body wrote its
    new carry into a carried input's storage, the outer graph then reused that storage for the next
    loop's ys buffer, and the closure gradient was overwritten. No body may reuse an input buffer."""
    torch.manual_seed(0)
    w, b = torch.randn(3, 3, requires_grad=True), torch.randn(3, requires_grad=True)

    def step(c0, xs):
        c, ys = scan(rnn_cell(w, b), c0, xs, unroll=2)
        return torch.autograd.grad(c.pow(2).sum() + ys.pow(2).sum(), (w, b))

    c0, xs = torch.randn(2, 3), torch.randn(7, 2, 3)
    got, codes = run_and_get_code(torch.compile(step, backend="inductor"), c0, xs)
    assert_trees_close(got, step(c0, xs), atol=1e-5, rtol=1e-4)
    code = "\n".join(codes)
    assert code.count("while ") == 4  # forward and backward: blocks of 2 and a remainder step
    reused_inputs = [line for line in code.splitlines() if "# reuse" in line and "_graph_" in line
                     and "_arg" in line.split("=")[-1]]
    assert reused_inputs == []


@pytest.mark.parametrize("reverse", [False, True])
def test_plain_sum_losses_compile(reverse):
    """``carry.sum() + ys.sum()`` makes the backward's loop operands expanded (stride-0) views,
    which torch 2.9's while_loop lowering cannot take: they are materialized first."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    c0, xs = torch.randn(2, 3, requires_grad=True), torch.randn(5, 2, 3, requires_grad=True)

    def step(c0, xs):
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c0, xs, reverse=reverse, unroll=2)
        return torch.autograd.grad(c.sum() + ys.sum(), (c0, xs, w))

    assert_trees_close(torch.compile(step, backend="inductor")(c0, xs), step(c0, xs), atol=1e-5, rtol=1e-4)


def test_expanded_xs_in_forward():
    """An expanded xs (one row for every step) reaches the forward loop as a stride-0 operand."""
    row = torch.randn(1, 3)

    def f(c0):
        return scan(lambda c, x: (torch.sin(c) + x, c * 2), c0, row.expand(6, 3))

    c0 = torch.randn(3)
    assert_trees_close(torch.compile(f, backend="inductor")(c0), f(c0))


@pytest.mark.parametrize("b_step", ["used", "passed_through"])
def test_mixed_float64_float32_carry_trains_with_unroll(b_step):
    """The loss's gradient for the float32 carry is a slice of the float64/float32 cat's gradient,
    12 bytes into its buffer: a loop body writing its new carry gradient into that (donated) input
    ("used"), or returning the input itself ("passed_through": b is not changed, so neither is its
    gradient), made the loop's result unaligned and inductor asserted "16 bytes aligned"."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    a0, b0 = torch.randn(3, dtype=torch.float64, requires_grad=True), torch.randn(3, requires_grad=True)
    xs = torch.randn(7, 3, requires_grad=True)

    def cell(c, x):
        a, b = c
        return (torch.tanh(a @ w + x.double()), b), a.float() * (b if b_step == "used" else 2)

    def step(a0, b0, xs):
        (a, b), ys = scan(cell, (a0, b0), xs, unroll=2)
        loss = torch.cat([a.float(), b]).pow(2).sum() + ys.pow(2).sum()
        return torch.autograd.grad(loss, (a0, b0, xs, w))

    assert_trees_close(torch.compile(step, backend="inductor")(a0, b0, xs), step(a0, b0, xs), atol=1e-5, rtol=1e-4)
