"""A repeated scan call reuses its traced body and autograd plan, and never a stale one."""
import pytest
import torch
from conftest import assert_trees_close, reference_scan

import torch_scan_hop
from torch_scan_hop import scan

D = torch.float64
_GLOBAL_W = torch.randn(3, 3, dtype=D, requires_grad=True)


@pytest.fixture(autouse=True)
def _fresh_cache():
    torch_scan_hop.clear_cache()
    yield
    torch_scan_hop.clear_cache()


class Counting:
    """Counts how often the user's body runs (probe step, traces, eager steps)."""

    def __init__(self):
        self.calls = 0

    def wrap(self, body):
        def counted(c, x):
            self.calls += 1
            return body(c, x)
        return counted


def grads_of(fn, init, xs, params):
    carry, ys = fn(init, xs)
    loss = carry.pow(2).sum() + ys.sin().sum()
    return [carry, ys, *torch.autograd.grad(loss, params)]


def test_second_call_with_fresh_closure_over_same_module_does_not_retrace():
    lin = torch.nn.Linear(3, 3).double()
    counter = Counting()

    def make_body():  # a new closure object every call, as in a training loop
        def body(c, x):
            counter.calls += 1
            h = torch.tanh(lin(c) + x)
            return h, h.sum(-1)
        return body

    init, xs = torch.randn(2, 3, dtype=D), torch.randn(5, 2, 3, dtype=D)
    params = list(lin.parameters())
    first = grads_of(lambda i, x: scan(make_body(), i, x), init, xs, params)
    calls_first = counter.calls
    counter.calls = 0
    second = grads_of(lambda i, x: scan(make_body(), i, x), init, xs, params)
    assert calls_first >= 2  # probe step + trace
    assert counter.calls == 1  # only the eager probe step: no trace, no partition
    want = grads_of(lambda i, x: reference_scan(make_body(), i, x), init, xs, params)
    assert_trees_close(second, want)
    assert_trees_close(first, want)


def test_replaced_parameter_is_seen():
    lin = torch.nn.Linear(3, 3).double()
    body = lambda c, x: (torch.tanh(lin(c) + x), c.sum(-1))  # noqa: E731
    init, xs = torch.randn(2, 3, dtype=D), torch.randn(4, 2, 3, dtype=D)
    grads_of(lambda i, x: scan(body, i, x), init, xs, list(lin.parameters()))
    old = lin.weight  # alive, so only the key (not a dead weak reference) can tell
    lin.weight = torch.nn.Parameter(torch.randn(3, 3, dtype=D))
    assert old is not lin.weight
    params = list(lin.parameters())
    got = grads_of(lambda i, x: scan(body, i, x), init, xs, params)
    assert_trees_close(got, grads_of(lambda i, x: reference_scan(body, i, x), init, xs, params))


def test_changed_module_attribute_and_mode_are_seen():
    class Cell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 3, dtype=D))
            self.scale = 1.0
            self.drop = torch.nn.Dropout(0.0)

        def forward(self, c, x):
            h = torch.tanh(self.drop(c @ self.w) * self.scale + x)
            return h, h.sum(-1)

    cell = Cell()
    init, xs = torch.randn(2, 3, dtype=D), torch.randn(4, 2, 3, dtype=D)
    for scale in (1.0, 3.0):
        cell.scale = scale
        got = grads_of(lambda i, x: scan(cell, i, x), init, xs, [cell.w])
        assert_trees_close(got, grads_of(lambda i, x: reference_scan(cell, i, x), init, xs, [cell.w]))


def test_rebound_global_and_changed_closure_scalar_are_seen():
    global _GLOBAL_W
    init, xs = torch.randn(2, 3, dtype=D), torch.randn(4, 2, 3, dtype=D)

    def body_with(k):
        return lambda c, x: (torch.tanh(c @ _GLOBAL_W * k + x), c.sum(-1))

    for k in (1.0, 2.0):
        for _ in range(2):
            _GLOBAL_W = torch.randn(3, 3, dtype=D, requires_grad=True)
            got = grads_of(lambda i, x: scan(body_with(k), i, x), init, xs, [_GLOBAL_W])
            want = grads_of(lambda i, x: reference_scan(body_with(k), i, x), init, xs, [_GLOBAL_W])
            assert_trees_close(got, want)


def test_requires_grad_and_shape_changes_rebuild_the_plan():
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    body = lambda c, x: (torch.sin(c @ w) + x, (c * x).sum())  # noqa: E731
    for n, init_grad in ((4, False), (4, True), (6, True), (6, False)):
        init = torch.randn(2, 3, dtype=D, requires_grad=init_grad)
        xs = torch.randn(n, 2, 3, dtype=D, requires_grad=True)
        params = [w, xs] + ([init] if init_grad else [])
        got = grads_of(lambda i, x: scan(body, i, x), init, xs, params)
        assert_trees_close(got, grads_of(lambda i, x: reference_scan(body, i, x), init, xs, params))


def test_uncacheable_closure_still_gives_right_answers():
    class Slots:  # no __dict__: cannot be fingerprinted, so never cached
        __slots__ = ("w",)

    holder = Slots()
    init, xs = torch.randn(2, 3, dtype=D), torch.randn(4, 2, 3, dtype=D)
    body = lambda c, x: (torch.tanh(c @ holder.w + x), c.sum(-1))  # noqa: E731
    for _ in range(2):
        holder.w = torch.randn(3, 3, dtype=D, requires_grad=True)
        got = grads_of(lambda i, x: scan(body, i, x), init, xs, [holder.w])
        assert_trees_close(got, grads_of(lambda i, x: reference_scan(body, i, x), init, xs, [holder.w]))


def test_new_length_reuses_the_trace_and_plan():
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    counter = Counting()
    body = counter.wrap(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)))
    init = torch.randn(2, 3, dtype=D, requires_grad=True)
    grads_of(lambda i, x: scan(body, i, x), init, torch.randn(4, 2, 3, dtype=D), [w, init])
    for n in (7, 1):
        xs = torch.randn(n, 2, 3, dtype=D)
        counter.calls = 0
        got = grads_of(lambda i, x: scan(body, i, x), init, xs, [w, init])
        assert counter.calls == 0  # init requires grad: no probe step, and no re-trace for the new length
        assert_trees_close(got, grads_of(lambda i, x: reference_scan(body, i, x), init, xs, [w, init]))
