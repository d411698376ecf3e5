"""Eager remat of bodies that write in place (remat/writes.py, remat/recipes.py; issue 63 item 5).

Against the plain loop in float64: values, gradients and the closed-over buffer's contents after the
scan. A body writing into a closed-over tensor runs as the loop (one warning, counted); a body writing
into its carry after a recipe read it keeps remat (the recipe reads a copy taken before the write)."""
import warnings

import pytest
import torch
from conftest import reference_scan

from torch_scan_hop import ScanError, scan
from torch_scan_hop.remat import writes

D = torch.float64
POLICIES = ["recompute_all", "min_cut", "sqrt"]
ROWS = 5


def _closure_problem():
    g = torch.Generator().manual_seed(0)
    init = torch.randn(3, dtype=D, generator=g, requires_grad=True)
    xs = torch.randn(4, 3, dtype=D, generator=g, requires_grad=True)
    w = torch.randn(3, 3, dtype=D, generator=g, requires_grad=True)
    k0 = torch.randn(ROWS, 3, dtype=D, generator=g, requires_grad=True)
    return init, xs, w, k0


def _closure_body(w, k):
    def body(c, x, t):
        h = torch.tanh(c @ w + x + k[(t - 1) % ROWS] * 0.5)
        k[t] = k[t] + h  # a write into the closed-over buffer: re-running it would add twice
        return h * 0.9, k.sum(0) * 0.1 + h
    return body


def _loop(body, init, xs):
    c, ys = init, []
    for t in range(xs.shape[0]):
        c, y = body(c, xs[t], torch.tensor(t))
        ys.append(y)
    return c, torch.stack(ys)


def _run(run, init, xs, w, k0):
    k = k0.clone()  # the buffer written: a copy of the leaf gradients are taken of
    c, ys = run(_closure_body(w, k), init, xs)
    loss = (c * torch.arange(1.0, 4.0, dtype=D)).sum() + (ys * ys).sum() + (k * k).sum()
    return [c, ys, k, *torch.autograd.grad(loss, (init, xs, w, k0))]


@pytest.mark.parametrize("policy", POLICIES)
def test_closure_writes_run_as_the_loop(policy):
    inputs = _closure_problem()
    want = _run(_loop, *inputs)
    before = writes.counts().get("plain", 0)
    with pytest.warns(writes.RematWritesWarning, match="writes in place into a tensor from outside the step"):
        got = _run(lambda b, i, x: scan(b, i, x, remat=policy, with_index=True), *inputs)
    assert writes.counts()["plain"] == before + 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # values (the buffer's too) without a tape
        k = inputs[3].detach().clone()
        want_k = k.clone()
        want_c, want_ys = _loop(_closure_body(inputs[2], want_k), inputs[0], inputs[1])
        with pytest.warns(writes.RematWritesWarning):
            c, ys = scan(_closure_body(inputs[2], k), inputs[0], inputs[1], remat=policy, with_index=True)
        torch.testing.assert_close((c, ys, k), (want_c, want_ys, want_k), rtol=1e-10, atol=1e-12)


def test_a_later_first_write_into_a_closed_over_tensor_is_refused():
    k = torch.zeros(ROWS, 3, dtype=D)

    def body(c, x, t):
        if int(t) == 2:
            k[t] = c
        return torch.tanh(c + k[0] + x), c.sum()

    init = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.raises(ScanError, match="step 2 wrote in place into a tensor from outside the step"):
        scan(body, init, torch.randn(4, 3, dtype=D), remat="recompute_all", with_index=True)


@pytest.mark.parametrize("policy", ["recompute_all", "min_cut"])
def test_a_recipe_reads_the_carry_before_the_body_writes_it(policy):
    """``b`` is read (expand, a recipe's input) before ``b.mul_`` writes it: the recipe reads a copy."""
    g = torch.Generator().manual_seed(1)
    a0, b0, w = (torch.randn(s, dtype=D, generator=g, requires_grad=True) for s in [(), (3,), (3, 3)])
    xs = torch.randn(3, 3, dtype=D, generator=g, requires_grad=True)

    def body(carry, x):
        a, b = carry
        a.mul_(torch.sigmoid(b.expand(2, 3).mean()))
        b.mul_(torch.sigmoid(a.expand(2, 3).mean(0)))
        v = torch.matmul(b.expand(2, 3) + x, w) * 0.5
        return (torch.tanh(v).mean(), torch.tanh(v).mean(0)), v.sum(-1)

    def run(f):
        (a, b), ys = f(body, (a0.clone(), b0.clone()), xs)
        loss = a * 2 + (b * b).sum() + (ys * ys).sum()
        return [a, b, ys, *torch.autograd.grad(loss, (a0, b0, w, xs))]

    def loop(body, init, xs):
        c, ys = init, []
        for x in xs:
            c, y = body(c, x)
            ys.append(y)
        return c, torch.stack(ys)

    want = run(loop)
    with warnings.catch_warnings():  # remat stays on: the carry is the step's own
        warnings.simplefilter("error", writes.RematWritesWarning)
        got = run(lambda b, i, x: scan(b, i, x, remat=policy))
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_carry_that_a_write_made_require_grad_is_kept_with_the_flag_it_began_with(policy):
    """``a.mul_(sigmoid(u))``: ``a`` does not require grad, ``u`` does from step 1 on. Kept, then
    written, that step's carry is computed again; it took the flags the write left (``a`` requiring
    grad), and its re-run saved a tensor more than the step did, a ScanError (fuzz seed 25092)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 3, dtype=D, generator=g, requires_grad=True)
    init = (torch.rand(2, dtype=D, generator=g) + 0.5, torch.randn(3, dtype=D, generator=g))
    xs = torch.randn(4, 3, dtype=D, generator=g, requires_grad=True)

    def body(c, x):
        a, u = c
        a.mul_(torch.sigmoid(u.mean()))
        return (a, torch.tanh(u @ w + x)), a.sum()

    def run(scan_fn):
        (a, u), ys = scan_fn(body, tuple(t.clone() for t in init), xs)
        return [a, u, ys, *torch.autograd.grad((a * 2).sum() + u.sum() + ys.sum(), (w, xs))]

    got, want = run(lambda *a: scan(*a, remat=policy)), run(reference_scan)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)

