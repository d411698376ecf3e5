"""A counted loop of the Python wrapper whose body only calls C++ kernels runs as one C++ kernel
(``inductor.codegen.loop_kernel``): one call in the generated code instead of a Python ``for``, the same
numbers as the Python loop (bit for bit: the same kernels on the same pointers in the same order)
and as the eager loop; anything else keeps the Python loop."""
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._pytree import tree_leaves
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import scan
from torch_scan_hop.inductor import codegen

_CALL = re.compile(r"^ *scan_steps_buf\d+\(", re.M)
_PY_LOOP = re.compile(r"^ *for \w+_step in range\(", re.M)


def _rnn(h=16, b=4):
    w = (torch.randn(h, h) * 0.3).requires_grad_()

    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)
    return w, step


def _train(scan_fn, step, params, c0, xs, **kw):
    """Forward values, then the gradients of params, init and xs."""
    c, ys = scan_fn(step, c0, xs, **kw)
    loss = sum(t.sum() for t in tree_leaves((c, ys)))
    grads = torch.autograd.grad(loss, [*params, *tree_leaves((c0, xs))])
    return [c, ys, *grads]


def _compiled(step, params, c0, xs, fused=True, mark_length=False, **kw):
    """Values and gradients of the compiled training step, and the generated codes."""
    torch._dynamo.reset()
    fn = torch.compile(lambda c0, xs: scan(step, c0, xs, **kw))

    def run():
        if mark_length:
            for t in tree_leaves(xs):
                torch._dynamo.mark_dynamic(t, 0)
        c, ys = fn(c0, xs)
        loss = sum(t.sum() for t in tree_leaves((c, ys)))
        return [c, ys, *torch.autograd.grad(loss, [*params, *tree_leaves((c0, xs))])]

    with torch._inductor.config.patch(force_disable_caches=True):
        if fused:
            return run_and_get_code(run)
        with codegen.passes_off("run_loops_as_one_kernel"):
            return run_and_get_code(run)


def _assert_one_call_per_loop(codes, loops=1):
    for code in codes:  # forward, backward
        assert len(_CALL.findall(code)) == loops and not _PY_LOOP.search(code), code[code.find("def call"):][:3000]


def _inputs(length, h=16, b=4):
    return torch.randn(b, h, requires_grad=True), torch.randn(length, b, h, requires_grad=True)


@pytest.mark.parametrize("reverse", [False, True])
def test_training_loops_are_one_call_with_the_python_loops_bits(reverse):
    w, step = _rnn()
    c0, xs = _inputs(70)
    got, codes = _compiled(step, [w], c0, xs, reverse=reverse)
    _assert_one_call_per_loop(codes)
    assert re.search(r"^ *scan_steps_buf\d+\(.*; buf\d+\[\d+\] = buf\d+_pool\d+\[0\] if ", codes[1], re.M), \
        "the weight gradient is not accumulated in place (codegen.accumulate)"
    want, old_codes = _compiled(step, [w], c0, xs, fused=False, reverse=reverse)
    assert all(len(_PY_LOOP.findall(code)) == 1 for code in old_codes)
    for g, o in zip(tree_leaves(got), tree_leaves(want)):
        assert torch.equal(g, o), (g - o).abs().max()
    assert_trees_close(got, _train(reference_scan, step, [w], c0, xs, reverse=reverse), rtol=1e-4, atol=1e-5)


def _mlp(params):
    def step(c, x):
        for w, bias in zip(params[::2], params[1::2]):
            c = torch.tanh((c + x) @ w + bias)
        return c, c.mean(-1)
    return step


def test_bias_gradients_summed_as_views_stay_in_the_kernel():
    """``h @ w + bias``'s bias gradient is summed as (1, n) and handed on as its (n,) view
    (inductor's ``reinterpret_tensor(...); del ...  # reuse``): pooled with its buffer, the
    backward is still one C++ call (it was a Python loop with an allocation per step), and the
    loop's last bias gradient is that view of the pool's last slot."""
    h, b = 64, 16  # at 16 x 4 inductor sums the bias gradient into an (n,) buffer itself
    params = [(torch.randn(*shape) * 0.3).requires_grad_() for shape in [(h, h), (h,), (h, h), (h,)]]
    step = _mlp(params)
    c0, xs = _inputs(67, h, b)
    got, codes = _compiled(step, params, c0, xs)
    _assert_one_call_per_loop(codes)
    assert re.search(r"= reinterpret_tensor\(buf\d+_pool\d+\[\(67 - 1\) & 1\], \(64, \), \(1, \), 0\)", codes[1])
    want, _ = _compiled(step, params, c0, xs, fused=False)
    for g, o in zip(tree_leaves(got), tree_leaves(want)):
        assert torch.equal(g, o), (g - o).abs().max()
    # gradients up to ~30 summed over 67 steps: the float32 loop itself is 5e-4 off the float64 loop
    exact = [(p.detach().double().requires_grad_()) for p in [*params, c0, xs]]
    params, (c0, xs) = exact[:-2], exact[-2:]
    want = [t.float() for t in _train(reference_scan, _mlp(params), params, c0, xs)]
    assert_trees_close(got, want, rtol=1e-4, atol=1e-3)


def test_forward_only():
    w, step = _rnn()
    c0, xs = _inputs(64)
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        got, (code,) = run_and_get_code(torch.compile(lambda c0, xs: scan(step, c0, xs)), c0, xs)
        want = reference_scan(step, c0, xs)
    _assert_one_call_per_loop([code])
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


def test_dynamic_length():
    """A length Dynamo made symbolic is ``range(s0)``; the loop runs it as its ``n``."""
    w, step = _rnn()
    c0, xs = _inputs(80)
    got, codes = _compiled(step, [w], c0, xs, mark_length=True)
    _assert_one_call_per_loop(codes)
    assert_trees_close(got, _train(reference_scan, step, [w], c0, xs), rtol=1e-4, atol=1e-5)


def test_pytrees_of_carries_and_xs():
    """Two carries, a dict of xs, ys of two leaves (one a matmul's row of the stacked buffer)."""
    w, u = (torch.randn(8, 8) * 0.3).requires_grad_(), (torch.randn(8, 8) * 0.3).requires_grad_()

    def step(carry, x):
        h, s = carry
        h = torch.tanh(h @ w + x["a"] * s)
        s = torch.sigmoid(s + x["b"] @ u)
        return (h, s), {"h": h @ u, "sum": (h * s).sum(-1)}

    c0 = (torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True))
    xs = {"a": torch.randn(64, 3, 8, requires_grad=True), "b": torch.randn(64, 3, 8, requires_grad=True)}
    got, codes = _compiled(step, [w, u], c0, xs)
    _assert_one_call_per_loop(codes)
    assert_trees_close(got, _train(reference_scan, step, [w, u], c0, xs), rtol=1e-4, atol=1e-5)


def test_short_loops_stay_python_loops():
    """Under 64 steps one more C++ build on a cold cache would not pay back."""
    w, step = _rnn()
    c0, xs = _inputs(16)
    got, codes = _compiled(step, [w], c0, xs)
    assert all(not _CALL.search(code) and _PY_LOOP.search(code) for code in codes)
    assert_trees_close(got, _train(reference_scan, step, [w], c0, xs), rtol=1e-4, atol=1e-5)


def test_a_body_with_an_aten_call_stays_a_python_loop():
    """A float64 matmul is ATen's ``extern_kernels.mm``: not a C++ kernel, so the Python loop."""
    w = (torch.randn(16, 16, dtype=torch.float64) * 0.3).requires_grad_()

    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    c0 = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(64, 4, 16, dtype=torch.float64, requires_grad=True)
    got, codes = _compiled(step, [w], c0, xs)
    assert all(not _CALL.search(code) and _PY_LOOP.search(code) for code in codes)
    assert_trees_close(got, _train(reference_scan, step, [w], c0, xs))


def test_carries_that_swap():
    """``(a, b) -> (b, tanh(a + b x))``: the lowering copies a carry that leaves at another position
    into a buffer of its own, so the loop's carries still come from the pools, read by turns."""
    def step(carry, x):
        a, b = carry
        return (b, torch.tanh(a + b * x)), a.sum(-1)

    c0 = (torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True))
    xs = torch.randn(65, 4, 8, requires_grad=True)
    got, codes = _compiled(step, [], c0, xs)
    _assert_one_call_per_loop(codes[:1])
    want, _ = _compiled(step, [], c0, xs, fused=False)
    for g, o in zip(tree_leaves(got), tree_leaves(want)):
        assert torch.equal(g, o), (g - o).abs().max()
    assert_trees_close(got, _train(reference_scan, step, [], c0, xs), rtol=1e-4, atol=1e-5)
