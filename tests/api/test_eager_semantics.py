"""Eager scan is exactly the Python loop: grad-mode regions, custom autograd Functions, RNG,
side effects, requires_grad of outputs, in-place writes to closures, never a stale cached body,
thread safety and bounded caches.

Every check runs the same body through scan and through conftest.reference_scan; most run
both with gradients (the traced, cached path) and without (the eager fast path).
"""
import functools
import linecache
import os
import subprocess
import sys
import threading
import traceback

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import assert_trees_close, reference_scan
from torch.fx.experimental import proxy_tensor

import torch_scan_hop
from torch_scan_hop import scan

D = torch.float64


def inputs(n=4, grad=True):
    g = torch.Generator().manual_seed(n)
    init = torch.randn(2, 3, dtype=D, generator=g).requires_grad_(grad)
    return init, torch.randn(n, 2, 3, dtype=D, generator=g)


def run(scan_fn, body, init, xs, params=()):
    """Outputs and, when something requires grad, d(sum of float outputs)/d(init, params)."""
    out = scan_fn(body, init, xs)
    targets = [t for t in (init, *params) if t.requires_grad]
    floats = [t for t in pytree.tree_leaves(out) if t is not None and t.is_floating_point() and t.requires_grad]
    if not targets or not floats:
        return out, []
    return out, list(torch.autograd.grad(sum(t.sin().sum() for t in floats), targets, allow_unused=True,
                                         materialize_grads=True))


def assert_like_loop(body, grad=True, params=(), n=4):
    """grad=False runs under no_grad (the eager fast path), grad=True traces and caches."""
    init, xs = inputs(n, grad)
    with torch.set_grad_enabled(grad):
        (out, grads), (want_out, want_grads) = run(scan, body, init, xs, params), run(reference_scan, body, init, xs, params)
    assert_trees_close(out, want_out)  # values
    assert_trees_close(grads, want_grads)  # gradients w.r.t. init and params


# ------------------------------------------------------------------ autograd inside the body

def test_no_grad_region_inside_body():
    def body(c, x):
        with torch.no_grad():
            s = c * 2
        return torch.tanh(c * s + x), s

    assert_like_loop(body)


def test_enable_grad_region_inside_body_under_outer_no_grad():
    def body(c, x):
        with torch.enable_grad():
            h = c * 2
        return h + x, h

    init, xs = inputs()
    with torch.no_grad():
        got, want = scan(body, init, xs), reference_scan(body, init, xs)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in want]
    assert_trees_close(run(lambda *a: got, body, init, xs), run(lambda *a: want, body, init, xs))


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -g


def test_custom_autograd_functions_use_their_backward():
    w = torch.randn(3, 3, dtype=D, requires_grad=True)

    def body(c, x):
        q = StraightThroughRound.apply(c * 3) / 3
        return torch.tanh(q @ w + GradReverse.apply(x * c)), q

    assert_like_loop(body, params=(w,))


@pytest.mark.parametrize("grad", [True, False])
def test_branch_on_is_grad_enabled(grad):
    def body(c, x):
        if torch.is_grad_enabled():
            return torch.tanh(c * 2 + x), c
        return torch.tanh(c * 3 + x), -c

    init, xs = inputs(grad=True)
    with torch.set_grad_enabled(grad):
        (out, grads), (want_out, want_grads) = run(scan, body, init, xs), run(reference_scan, body, init, xs)
    assert_trees_close(out, want_out)  # values
    assert_trees_close(grads, want_grads)


# ------------------------------------------------------------------ RNG and side effects

@pytest.mark.parametrize("grad", [True, False])
def test_dropout_and_rand_draw_for_draw(grad):
    def body(c, x):
        return c + F.dropout(x, 0.5, training=True) * torch.rand(3, dtype=D), torch.randn((), dtype=D)

    init, xs = inputs(6, grad)
    torch.manual_seed(1)
    got = run(scan, body, init, xs)
    after_scan = torch.rand(4)
    torch.manual_seed(1)
    want = run(reference_scan, body, init, xs)
    assert_trees_close(got, want)
    assert torch.equal(after_scan, torch.rand(4)), "scan left the global RNG in another state than the loop"


@pytest.mark.parametrize("grad", [True, False])
def test_manual_seed_inside_body(grad):
    def body(c, x):
        torch.manual_seed(7)
        return c * torch.rand(3, dtype=D) + x, torch.rand((), dtype=D)

    assert_like_loop(body, grad)


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("grad", [True, False])
def test_side_effects_once_per_step(grad, warm, capsys):
    calls, draws = [], []

    def body(c, x):
        calls.append(1)
        print("step")
        draws.append(torch.rand(()).item())
        return torch.tanh(c + x), None

    init, xs = inputs(5, grad)
    if warm:
        scan(body, init, xs)
        calls.clear(), draws.clear(), capsys.readouterr()
    torch.manual_seed(3)
    scan(body, init, xs)
    got = (len(calls), capsys.readouterr().out.count("step\n"), list(draws))
    calls.clear(), draws.clear()
    torch.manual_seed(3)
    reference_scan(body, init, xs)
    assert got == (5, 5, draws), f"(calls, prints, draws) {got} != the loop's {(5, 5, draws)}"


def test_outputs_that_need_no_grad_do_not_require_grad():
    def body(c, x):
        return (c[0] * x, x), {"slice": x, "scaled": x * 2, "from_carry": c[1].abs(), "needs": c[0].sum()}

    init, xs = inputs()
    got, want = scan(body, (init, xs[0]), xs), reference_scan(body, (init, xs[0]), xs)
    flags = lambda tree: [t.requires_grad for t in pytree.tree_leaves(tree)]  # noqa: E731
    assert flags(got) == flags(want), f"requires_grad {flags(got)} != the loop's {flags(want)}"


@pytest.mark.parametrize("grad", [True, False])
def test_body_writing_into_a_closed_over_tensor(grad):
    def make():
        acc = torch.zeros(2, 3, dtype=D)

        def body(c, x):
            acc.add_(x)
            return c + acc, acc.clone()
        return body, acc

    init, xs = inputs(grad=grad)
    (body_s, acc_s), (body_l, acc_l) = make(), make()
    assert_trees_close(run(scan, body_s, init, xs), run(reference_scan, body_l, init, xs))
    assert_trees_close(acc_s, acc_l)


# ------------------------------------------------------------------ never a stale cached body

SCALE = 2.0


class Cell(torch.nn.Module):
    factor = 1.0

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3, dtype=D)
        self.scale, self._shift = 1.0, 0.0

    def forward(self, c, x):
        return torch.tanh(self.lin(c) * self.scale * self.factor + self._shift + x)


@pytest.fixture
def restore():
    global SCALE
    old = SCALE, Cell.factor
    yield
    SCALE, Cell.factor = old


@pytest.mark.parametrize("grad", [True, False])
def test_changed_global(grad, restore):
    global SCALE
    body = lambda c, x: (torch.tanh(c * SCALE + x), c * SCALE)  # noqa: E731
    assert_like_loop(body, grad)
    SCALE = 3.0
    assert_like_loop(body, grad)


CHANGES = {"attribute": lambda cell: setattr(cell, "scale", 3.0),
           "underscore_attribute": lambda cell: setattr(cell, "_shift", -0.5),
           "class_attribute": lambda cell: setattr(Cell, "factor", 0.25)}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("grad", [True, False])
def test_changed_module_and_class_attributes(grad, change, restore):
    cell = Cell()
    body = lambda c, x: (cell(c, x), None)  # noqa: E731
    params = tuple(cell.parameters())
    assert_like_loop(body, grad, params)
    CHANGES[change](cell)
    assert_like_loop(body, grad, params)


@pytest.mark.parametrize("grad", [True, False])
def test_hooks_registered_after_the_first_call(grad):
    cell = Cell()
    body = lambda c, x: (cell(c, x), None)  # noqa: E731
    params = tuple(cell.parameters())
    assert_like_loop(body, grad, params)
    post = cell.register_forward_hook(lambda m, args, out: out * 2)
    assert_like_loop(body, grad, params)
    pre = cell.lin.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    assert_like_loop(body, grad, params)
    post.remove(), pre.remove()
    assert_like_loop(body, grad, params)


@pytest.mark.parametrize("grad", [True, False])
def test_functools_partial_arguments(grad):
    def step(c, x, k, bias=0.0):
        return torch.tanh(c * k + x + bias), c * k

    assert_like_loop(functools.partial(step, k=2.0), grad)
    assert_like_loop(functools.partial(step, k=3.0), grad)
    assert_like_loop(functools.partial(step, k=3.0, bias=1.0), grad)


@pytest.mark.parametrize("grad", [True, False])
def test_closed_over_tensor_read_as_python_bool_after_in_place_update(grad):
    flag = torch.tensor(True)
    body = lambda c, x: (torch.tanh((c * 2 if flag else c * 3) + x), None)  # noqa: E731
    assert_like_loop(body, grad)
    flag.fill_(False)
    assert_like_loop(body, grad)


@pytest.mark.parametrize("grad", [True, False])
def test_zero_and_negative_zero_constants(grad):
    def make(k):  # atan2(+0.0, -1) = pi, atan2(-0.0, -1) = -pi
        return lambda c, x: (torch.tanh(c + x), torch.atan2(torch.full_like(x, k), -torch.ones_like(x)))

    assert_like_loop(make(0.0), grad)
    assert_like_loop(make(-0.0), grad)


# ------------------------------------------------------------------ threads and caches

def in_subprocess(request):
    """Re-run this test alone in a fresh interpreter (threads can wreck process-global tracing state)."""
    if os.environ.get("SCAN_TEST_IN_SUBPROCESS"):
        return False
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/api/ -> the repository
    env = dict(os.environ, SCAN_TEST_IN_SUBPROCESS="1",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", "--tb=short",
           "--rootdir", repo, f"{__file__}::{request.node.name}"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    return True


@pytest.mark.parametrize("warm", [False, True])
def test_four_threads_with_gradients(warm, request):
    if in_subprocess(request):
        return
    ws = [torch.randn(3 + i, 3 + i, dtype=D, requires_grad=True) for i in range(4)]
    cases = [(lambda c, x, w=w: (torch.tanh(c @ w + x), c.sum(-1)), torch.randn(2, 3 + i, dtype=D, requires_grad=True),
              torch.randn(5 + i, 2, 3 + i, dtype=D), w) for i, w in enumerate(ws)]
    want = [run(reference_scan, body, init, xs, (w,)) for body, init, xs, w in cases]
    torch_scan_hop.clear_cache()
    if warm:
        [run(scan, body, init, xs, (w,)) for body, init, xs, w in cases]
    barrier, got, errors = threading.Barrier(4), [None] * 4, []

    def worker(i):
        try:
            body, init, xs, w = cases[i]
            barrier.wait()
            for _ in range(3):
                got[i] = run(scan, body, init, xs, (w,))
        except BaseException as e:  # noqa: BLE001
            errors.append(traceback.format_exc()[-1500:])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    for g, w in zip(got, want):
        assert_trees_close(g, w)
    assert proxy_tensor._CURRENT_MAKE_FX_TRACER is None
    assert torch.is_grad_enabled()


def test_fresh_modules_do_not_grow_linecache():
    """SCAN_LEAK_CALLS (default 100; 2000 for the full check) calls, each with a new module."""
    calls = int(os.environ.get("SCAN_LEAK_CALLS", 100))
    init, xs = inputs()

    def one_call():
        lin = torch.nn.Linear(3, 3, dtype=D)
        scan(lambda c, x: (torch.tanh(lin(c) + x), None), init, xs)[0].sum().backward()

    for _ in range(20):
        one_call()
    before = len(linecache.cache)
    for _ in range(calls):
        one_call()
    assert len(linecache.cache) - before <= 20, f"linecache grew by {len(linecache.cache) - before} in {calls} calls"
