"""A scan in a scan's body (what traced ``remat="sqrt"`` is made of, and what users write) gets the
same codegen under inductor as a top-level one: both loops ``for <loop>_step in range(n)`` with
their bodies inlined and their buffers pooled (``inductor.lowering._rename_nested_loops``), none a
generic while_loop subgraph called every step; values and gradients against the Python loop."""
import math

import pytest
import torch
from conftest import assert_trees_close, reference_scan
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan


def _generic_loop_functions(code):
    """Subgraph functions of inductor's generic while_loop codegen (called every step)."""
    return [part.split("(")[0] for part in code.split("\ndef ")[1:] if "while_loop" in part.split("(")[0]]


def _nested(run, w, reverse):
    def inner(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    def outer(c, xb):
        c, ys = run(inner, c, xb, reverse=reverse)
        return c * 0.9, ys

    return outer


def _problem(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, dtype=dtype, generator=g) * 0.3
    c = torch.randn(4, 8, dtype=dtype, generator=g)
    xs = torch.randn(3, 5, 4, 8, dtype=dtype, generator=g)  # 3 blocks of 5 steps
    return w, c, xs


@pytest.mark.parametrize("reverse", [False, True])
def test_nested_forward_runs_both_loops_as_for_loops(reverse):
    torch._dynamo.reset()
    w, c, xs = _problem()

    def f(run, c, xs):
        return run(_nested(run, w, reverse), c, xs, reverse=reverse)

    with torch.no_grad():
        got, codes = run_and_get_code(torch.compile(lambda c, xs: f(scan, c, xs), fullgraph=True), c, xs)
    assert_trees_close(got, f(reference_scan, c, xs))
    code = "\n".join(codes)
    assert "_step in range(3):" in code and "_step in range(5):" in code, code[-4000:]
    assert _generic_loop_functions(code) == []
    assert "_pool0[" in code  # the inner loop's buffers come from its pools


@pytest.mark.parametrize("reverse", [False, True])
def test_nested_training_step_matches_the_loop(reverse):
    torch._dynamo.reset()

    def loss(run, w, c, xs):
        carry, ys = run(_nested(run, w, reverse), c, xs, reverse=reverse)
        weights = torch.arange(1, ys.numel() + 1, dtype=ys.dtype).reshape(ys.shape)  # ys' order matters
        return carry.square().sum() + (ys * weights).sum()

    def grads(fn):
        leaves = [t.requires_grad_() for t in _problem()]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    compiled = torch.compile(lambda w, c, xs: loss(scan, w, c, xs), fullgraph=True)
    got, codes = run_and_get_code(grads, compiled)
    assert_trees_close(got, grads(lambda w, c, xs: loss(reference_scan, w, c, xs)), atol=1e-10, rtol=1e-10)
    code = "\n".join(codes)
    # forward: outer and inner; backward: outer, and in its body the inner's backward
    assert code.count("_step in range(3):") == 2 and code.count("_step in range(5):") == 2, code[-4000:]
    assert _generic_loop_functions(code) == []


@pytest.mark.parametrize("length", [9, 10, 16])
def test_traced_sqrt_training_step_runs_for_loops_only(length):
    """Traced ``remat="sqrt"``: an outer recompute_all scan over blocks of k = ceil(sqrt(T))
    steps, an inner save_all scan per block (its forward run again in the outer backward), and a
    tail of T % k steps (T=10: 2 blocks of 4, 2 left)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(6, 6, dtype=torch.float64, generator=g) * 0.4).requires_grad_()
    c = torch.randn(3, 6, dtype=torch.float64, generator=g).requires_grad_()
    xs = torch.randn(length, 3, 6, dtype=torch.float64, generator=g).requires_grad_()

    def cell(h, x):
        h = torch.tanh(h @ w + x)
        return h, h.sum(-1)

    def step(run):
        def f(c, xs):
            h, ys = run(cell, c, xs)
            weights = torch.arange(1, length + 1, dtype=ys.dtype)[:, None]
            return torch.autograd.grad(h.square().sum() + (ys * weights).sum(), (w, c, xs))
        return f

    got, codes = run_and_get_code(torch.compile(step(lambda *a: scan(*a, remat="sqrt"))), c, xs)
    assert_trees_close(got, step(reference_scan)(c, xs), atol=1e-10, rtol=1e-10)
    code = "\n".join(codes)
    assert _generic_loop_functions(code) == [], _generic_loop_functions(code)
    k = math.ceil(math.sqrt(length))
    assert f"_step in range({length // k}):" in code and f"_step in range({k}):" in code
    # the forward's inner scans (in the outer loop's body) stack nothing for a backward, which runs them again
    def stacked_in_outer_body(code):
        return [line for line in code.split("\n") if line.startswith(" " * 12) and f"_cpu(({k}, 3, 6)" in line]
    assert stacked_in_outer_body(codes[0]) == [] and stacked_in_outer_body(codes[1]) != []


def test_a_users_while_loop_next_to_a_nested_scan_keeps_inductors_loop():
    """Only the loops lowered from scans get the for-loop codegen: a while_loop the user wrote in
    the body (its counter starts at 2, so ``range(5)`` would run it 5 times, not 3) stays
    inductor's own, while the nested scan next to it becomes a for loop."""
    from torch._higher_order_ops.while_loop import while_loop

    torch._dynamo.reset()
    w, c, xs = _problem()

    def twice_more(h, x, scale):  # i = 2, 3, 4
        return while_loop(lambda i, h: i < 5, lambda i, h: (i + 1, torch.tanh(h @ w + x[0] * i * scale)),
                          (torch.tensor(2), h))[1]

    def ref_twice_more(h, x, scale):
        for i in range(2, 5):
            h = torch.tanh(h @ w + x[0] * i * scale)
        return h

    def make(run, loop):
        def f(c, xb):
            c, ys = run(_nested(run, w, False), c, xb)
            return loop(c, xb, 0.1), ys
        return f

    with torch.no_grad():
        got, codes = run_and_get_code(torch.compile(lambda c, xs: scan(make(scan, twice_more), c, xs), fullgraph=True),
                                      c, xs)
    assert_trees_close(got, reference_scan(make(reference_scan, ref_twice_more), c, xs))
    code = "\n".join(codes)
    assert "_step in range(3):" in code and "_step in range(5):" in code
    assert len(_generic_loop_functions(code)) == 2  # the user's loop: its cond and body


def test_ys_nothing_reads_are_not_stacked():
    """A scan's ys that no one reads get no buffer and no copy per step; the rest stay right."""
    torch._dynamo.reset()
    w, c, xs = _problem()
    xs = xs[0]

    def f(run, c, xs):
        carry, (_, small) = run(lambda c, x: (torch.tanh(c @ w + x), (c[:, :, None] * x[:, None], c.sum(-1))), c, xs)
        return carry, small

    with torch.no_grad():
        got, codes = run_and_get_code(torch.compile(lambda c, xs: f(scan, c, xs), fullgraph=True), c, xs)
    assert_trees_close(got, f(reference_scan, c, xs))
    assert "(5, 4, 8, 8)" not in codes[0] and "(5, 4)" in codes[0]
