"""Inductor writes a step's matmul and reduction outputs straight into their rows of the stacked buffers.

A scan's ys (in training: every saved activation and every stacked weight gradient) are rows of
preallocated buffers. A y made by an extern kernel (mm/addmm/bmm) or a reduction is written by
that kernel into its row, not into a temporary copied there; a partition saves the base of several views of one
value (q, k, v split from one matmul) once, so that matmul too writes its row directly. Values
and float64 gradients against the Python loop, for every kind of y the direct write must leave
alone (a y that is also the carry, one y returned twice, a transposed y)."""
import operator
import re

import pytest
import torch
from conftest import assert_trees_close
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import fwd_bwd, scan

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
D = torch.float64


def loop(body, c, xs, reverse):
    ys = [None] * xs.shape[0]
    for i in (reversed(range(xs.shape[0])) if reverse else range(xs.shape[0])):
        c, ys[i] = body(c, xs[i])
    return c, torch.utils._pytree.tree_map(lambda *t: torch.stack(t), *ys)


def bodies(W, b, W3):
    return {
        "matmul y": lambda c, x: (torch.tanh(c @ W + x), c @ W),
        "y is the carry": lambda c, x: (c @ W * 0.5, c @ W * 0.5),
        "y returned twice": lambda c, x: (torch.tanh(c + x), ((c @ W), (c @ W))),
        "y from x": lambda c, x: (c + 1, x @ W),
        "addmm y": lambda c, x: (torch.sin(c) + x, torch.addmm(b, c, W)),
        "bmm y": lambda c, x: (c * 0.9 + x, torch.bmm(W3, W3 + c.sum())),
        "transposed y": lambda c, x: (torch.tanh(c @ W + x), (c @ W).t()),
        "y read later": lambda c, x: (lambda m: (torch.tanh(m + x), m * 2))(c @ W),
        "outer product y": lambda c, x: (c + x, c.t() @ x),
        "sum y": lambda c, x: (torch.tanh(c @ W + x), c.sum(-1)),
        "sum y read later": lambda c, x: (lambda s: (torch.tanh(c + x) * s.unsqueeze(-1), s))(c.sum(-1)),
        "sum y is the carry": lambda c, x: (lambda s: (s, s))((c.unsqueeze(-1) * x.unsqueeze(-2)).sum(-1)),
        "max and sum ys": lambda c, x: (c * 0.5 + x, (c.amax(0), (c * x).sum())),
    }


SCHEDULES = ((False, 1, 5), (True, 1, 4), (True, 2, 5), (False, 3, 4))  # reverse, unroll, length
# each body forward under one schedule and reversed under another, in turn, so every schedule meets six
# or seven bodies (every body under every schedule compiled 52 graphs for no new kind of row)
CASES = [(name, *SCHEDULES[(i + k) % len(SCHEDULES)]) for i, name in enumerate(bodies(None, None, None))
         for k in (0, 2)]


@pytest.mark.parametrize("name,reverse,unroll,n", CASES)
def test_matmul_ys_match_the_loop(name, reverse, unroll, n):
    gen = torch.Generator().manual_seed(n)
    rand = lambda *s: torch.randn(*s, dtype=D, generator=gen)  # noqa: E731
    W, b, W3 = rand(5, 5), rand(5), rand(2, 5, 5)
    c0, xs = rand(3, 5), rand(n, 3, 5)
    leaves = [t.requires_grad_() for t in (c0, xs, W, b, W3)]
    body = bodies(W, b, W3)[name]
    compiled = torch.compile(lambda c, xs: scan(body, c, xs, reverse=reverse, unroll=unroll),
                             backend="inductor", fullgraph=True)
    got, want = compiled(c0, xs), loop(body, c0, xs, reverse)
    assert_trees_close(got, want, rtol=1e-7, atol=1e-9)
    outs_got, outs_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    cot = [torch.randn_like(t) for t in outs_want]
    g_got = torch.autograd.grad(outs_got, leaves, cot, allow_unused=True)
    g_want = torch.autograd.grad(outs_want, leaves, cot, allow_unused=True)
    zeros_for_none = lambda gs: [torch.zeros_like(t) if g is None else g for g, t in zip(gs, leaves)]  # noqa: E731
    assert_trees_close(zeros_for_none(g_got), zeros_for_none(g_want), rtol=1e-7, atol=1e-9)


def _written_into_rows(code):
    """Names of kernel outputs that are views of a loop body's input (a row of a ys buffer)."""
    return re.findall(r"(\w*buf\d+) = reinterpret_tensor\(\w*arg\d+_1, .*# alias", code)


def test_weight_gradients_are_written_into_their_rows():
    """A training backward of a scan over stacked weights: each step's weight gradient (c.T @ g)
    is written by its matmul into the stacked gradient, no copy kernel after it."""
    Ws = torch.randn(6, 8, 8, dtype=D, requires_grad=True)
    c0 = torch.randn(4, 8, dtype=D, requires_grad=True)

    def f(c0, Ws):
        return scan(lambda c, w: (torch.tanh(c @ w), None), c0, Ws)[0].sum()

    compiled = torch.compile(f, backend="inductor")
    _, (fwd, bwd) = run_and_get_code(lambda: torch.autograd.grad(compiled(c0, Ws), (c0, Ws)))
    assert len(_written_into_rows(bwd)) == 1, bwd
    c = c0
    for i in range(Ws.shape[0]):
        c = torch.tanh(c @ Ws[i])
    got = torch.autograd.grad(compiled(c0, Ws), (c0, Ws))
    assert_trees_close(got, torch.autograd.grad(c.sum(), (c0, Ws)), rtol=1e-5, atol=1e-6)


def test_reduction_ys_are_computed_into_their_rows():
    """A y that is a reduction (``c.sum(-1)``) is computed by its kernel straight into its row
    of the stacked ys: no buffer of its own per step, no copy after it. (Where each row starts
    16-byte aligned, as here: a batch of 4 float64 sums; otherwise the reduction keeps its buffer.)"""
    W = torch.randn(16, 16, dtype=D)  # rows of 16: a reduction loop (8 or fewer are unrolled into a pointwise)
    body = bodies(W, None, None)["sum y"]
    c0, xs = torch.randn(4, 16, dtype=D), torch.randn(7, 4, 16, dtype=D)
    compiled = torch.compile(lambda c, xs: scan(body, c, xs), backend="inductor", fullgraph=True)
    got, (code,) = run_and_get_code(compiled, c0, xs)
    assert len(_written_into_rows(code)) == 1, code
    assert_trees_close(got, loop(body, c0, xs, False), rtol=1e-7, atol=1e-9)


def test_views_of_one_value_are_saved_once():
    """q, k and v split from one matmul: the partition saves the matmul's output once (the backward
    re-views it), not three views a scan would each copy into a stacked buffer."""
    W = torch.randn(8, 24, requires_grad=True)

    def body(c, x):
        q, k, v = (c @ W).split(8, dim=-1)
        return torch.tanh(q * k * v + x), None

    step = fwd_bwd(body, torch.randn(4, 8, requires_grad=True), torch.randn(4, 8))
    (outs,) = step.fwd.graph.find_nodes(op="output")[0].args
    saved = {n.name: (n.target, tuple(n.meta["val"].shape)) for n in outs[1:]}
    assert [shape for _, shape in saved.values()].count((4, 24)) == 1, saved
    assert not any(target is operator.getitem for target, _ in saved.values()), saved


def test_qkv_matmul_writes_its_saved_row():
    """The same body in a compiled training step: the q/k/v matmul writes its row of the saved
    stack (and the weight gradient its row of the stacked gradient); values and gradients
    match the loop."""
    Ws = torch.randn(5, 8, 24, dtype=D, requires_grad=True)
    c0 = torch.randn(4, 8, dtype=D, requires_grad=True)

    def body(c, w):
        q, k, v = (c @ w).split(8, dim=-1)
        return torch.tanh(q * k * v), None

    def f(c0, Ws):
        return scan(body, c0, Ws)[0]

    compiled = torch.compile(f, backend="inductor")
    (out, grads), (fwd, bwd) = run_and_get_code(
        lambda: (lambda o: (o, torch.autograd.grad(o.sum(), (c0, Ws))))(compiled(c0, Ws)))
    assert len(_written_into_rows(fwd)) == 1, fwd
    assert len(_written_into_rows(bwd)) == 1, bwd
    c = c0
    for i in range(Ws.shape[0]):
        c, _ = body(c, Ws[i])
    assert_trees_close(out, c, rtol=1e-7, atol=1e-9)
    assert_trees_close(grads, torch.autograd.grad(c.sum(), (c0, Ws)), rtol=1e-7, atol=1e-9)


IDS = torch.tensor([0, 1, 1, 3, 0, 2])
# a y that a kernel computes and another op then writes into: every row gets the written values
WRITTEN_AFTER = {
    "indexed rows (their gradient: zeros, then index_put accumulate)": lambda c, b: (c + b[IDS] * 0.5, None),
    "gather (scatter_add)": lambda c, b: (c * b.gather(0, IDS[:, None].expand(6, 3)), None),
    "index_select (index_add)": lambda c, b: (torch.tanh(c + b.index_select(0, IDS)), None),
    "embedding (an MoE expert bias)": lambda c, b: (c + torch.nn.functional.embedding(IDS, b), None),
    "a y that is index_add_ into zeros": lambda c, b: (c * 0.9 + b[0], torch.zeros(4, 3, dtype=D).index_add_(0, IDS, c)),
}


@pytest.mark.parametrize("name", list(WRITTEN_AFTER))
def test_a_y_written_after_its_kernel_keeps_the_writes(name):
    """A y computed into a buffer that a later op writes into (``zeros`` then a scatter: the
    gradient of ``b[ids]``, so of every MoE expert bias) is not moved into its row, which lost
    the scatter: its rows were zeros. Values and float64 gradients against the loop."""
    body = WRITTEN_AFTER[name]
    bs = torch.randn(5, 4, 3, dtype=D, requires_grad=True)
    c0 = torch.randn(6, 3, dtype=D, requires_grad=True)
    got = torch.compile(lambda c, b: scan(body, c, b), backend="inductor")(c0, bs)
    c, ys = c0, []
    for b in bs:
        c, y = body(c, b)
        ys.append(y)
    want = (c, None if ys[0] is None else torch.stack(ys))
    assert_trees_close(got, want, rtol=1e-7, atol=1e-9)
    got_g = torch.autograd.grad(got[0].sum(), (c0, bs))
    assert_trees_close(got_g, torch.autograd.grad(want[0].sum(), (c0, bs)), rtol=1e-7, atol=1e-9)
