"""Traced ``remat="sqrt"`` (issue 36): two scans, an outer one over blocks of k = ceil(sqrt(T)) steps
saving only the carry at each block start, an inner one over a block (``api._sqrt_scan``). Values and
gradients against the Python loop under make_fx, torch.compile, export and XLA, and what it saves."""
import math

import pytest
import torch
from conftest import assert_trees_close, reference_scan
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import ScanError, api, scan

LENGTHS = (0, 1, 2, 5, 9, 16)


def _problem(length, seed=0):
    """A pytree carry (float and int leaves), pytree xs scanned along dim 1 for one leaf, a closed-over
    weight, and a y with a None leaf."""
    torch.manual_seed(seed)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def body(c, x):
        h = torch.tanh(c["h"] @ w + x["a"]) * (1 + x["b"].sum(-1, keepdim=True))
        return {"h": h, "n": c["n"] + 1}, (h.sum(-1), None)

    h = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, length, 3, dtype=torch.float64, requires_grad=True)  # scanned along dim 1
    b = torch.randn(2, length, 4, dtype=torch.float64, requires_grad=True)
    return body, h, a, b, w


def _loss(c, ys, length):
    weights = torch.arange(1, length + 1, dtype=torch.float64)[:, None]  # ys' order matters
    return c["h"].sum() + (ys[0] * weights).sum() if length else c["h"].sum()


def _run(scan_fn, body, h, a, b, w, length, reverse):
    init = {"h": h, "n": torch.zeros((), dtype=torch.int64)}
    c, ys = scan_fn(body, init, {"a": a, "b": b}, reverse=reverse)
    grads = torch.autograd.grad(_loss(c, ys, length), [h, a, b, w], allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip((h, a, b, w), grads)]
    return [c["h"], c["n"], *(ys if length else ()), *grads]


def _want(length, reverse, seed=0):
    body, h, a, b, w = _problem(length, seed)
    return _run(lambda *args, **kw: reference_scan(*args, dim=1, **kw), body, h, a, b, w, length, reverse)


def _sqrt(body, init, xs, reverse):
    return scan(body, init, xs, dim=1, reverse=reverse, remat="sqrt")


@pytest.fixture
def rewrites(monkeypatch):
    """How many scans were rewritten into two (the paths whose graphs the tests below do not read)."""
    calls = []
    real = api._sqrt_scan

    def spy(*args):
        calls.append(args[2].length)
        return real(*args)

    monkeypatch.setattr(api, "_sqrt_scan", spy)
    return calls


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("length", LENGTHS)
def test_make_fx_matches_the_loop(length, reverse):
    body, h, a, b, w = _problem(length)
    gm = make_fx(lambda h, a, b, w: _run(_sqrt, body, h, a, b, w, length, reverse))(h, a, b, w)
    assert_trees_close(gm(h, a, b, w), _want(length, reverse))
    carries = sum(s[0] for s in _stacked_saves(gm, 2, 1, reverse) if s[1:] == (2, 3))  # saved copies of c["h"]
    k = math.ceil(math.sqrt(length))
    assert carries == (length if length < 2 else length // k + length % k)  # one per block, one per tail step


def _stacked_saves(gm, num_carry, num_y, reverse=False):
    """Shapes the forward scans of a make_fx'd training step stack for their backward: each forward
    scan node's outputs after its carries and ys (the backward scans run the other way)."""
    saved = []
    for n in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan):
        if n.kwargs.get("reverse", False) == reverse:
            saved += [tuple(v.shape) for v in n.meta["val"][num_carry + num_y:]]
    return saved


def test_the_outer_scan_saves_one_carry_per_block():
    w = torch.randn(4, 4, requires_grad=True)

    def body(c, x):
        h = torch.tanh(torch.sin(c @ w) + x)
        return h, h.sum(-1)

    def step(remat):
        def f(h, xs, w):
            c, ys = scan(body, h, xs, remat=remat)
            return torch.autograd.grad(c.sum() + ys.sum(), [h, xs, w])
        return make_fx(f)(torch.randn(2, 4, requires_grad=True), torch.randn(64, 2, 4, requires_grad=True), w)

    # T=64, k=8: the outer scan stacks the carry of each of its 8 blocks, nothing else (its x blocks are
    # views of xs; each block's own saved values live in the backward step that re-runs it)
    assert _stacked_saves(step("sqrt"), 1, 1) == [(8, 2, 4)]
    assert _stacked_saves(step("recompute_all"), 1, 1) == [(64, 2, 4)]  # one carry per step


def test_the_tail_of_a_length_k_does_not_divide_saves_its_carries():
    def body(c, x):
        return torch.sin(c) + x, None

    def f(h, xs):
        c, _ = scan(body, h, xs, remat="sqrt")
        return torch.autograd.grad(c.sum(), [h, xs])

    h, xs = torch.randn(3, requires_grad=True), torch.randn(70, 3, requires_grad=True)  # k=9: 7 blocks, tail 7
    gm = make_fx(f)(h, xs)
    assert sorted(_stacked_saves(gm, 1, 0)) == [(7, 3), (7, 3)]
    assert_trees_close(gm(h, xs), torch.autograd.grad(reference_scan(body, h, xs)[0].sum(), [h, xs]))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_xs_none_with_a_length(reverse):
    w = torch.randn(3, 3, requires_grad=True)

    def body(c, _):
        c = torch.tanh(c @ w)
        return c, c.sum()

    def f(h, w):
        c, ys = scan(body, h, None, length=10, reverse=reverse, remat="sqrt")
        loss = c.sum() + (ys * torch.arange(10.0)).sum()
        return [c, ys, *torch.autograd.grad(loss, [h, w])]

    h = torch.randn(2, 3, requires_grad=True)
    c, ys = reference_scan(body, h, None, length=10, reverse=reverse)
    want = [c, ys, *torch.autograd.grad(c.sum() + (ys * torch.arange(10.0)).sum(), [h, w])]
    gm = make_fx(f)(h, w)
    assert_trees_close(gm(h, w), want)
    assert sorted(_stacked_saves(gm, 1, 1, reverse)) == [(2, 2, 3), (2, 2, 3)]  # k=4: 2 blocks' carries, 2 tail steps'


def test_gradcheck_float64():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    body, h, a, b, w = _problem(7, seed=1)

    def f(h, a, b):
        c, ys = scan(body, {"h": h, "n": torch.zeros((), dtype=torch.int64)}, {"a": a, "b": b}, dim=1,
                     remat="sqrt")
        return c["h"], ys[0]

    forwards = []

    def keep(gm, _):
        forwards.append(gm)
        return make_boxed_func(gm.forward)

    # compiled, the analytical gradient is the traced two-level backward (AOTAutograd's)
    compiled = torch.compile(f, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    compiled(h, a, b)
    # T=7, k=3: the forward saves c["h"] at 2 block starts and 1 tail step, not 7 times
    assert sum(s[0] for s in _stacked_saves(forwards[0], 2, 1) if s[1:] == (2, 3)) == 3
    assert torch.autograd.gradcheck(compiled, (h, a, b))


@pytest.mark.parametrize("backend,length,reverse", [
    ("aot_eager", 0, False), ("aot_eager", 1, True), ("aot_eager", 2, False), ("aot_eager", 5, True),
    ("aot_eager", 9, False), ("aot_eager", 16, True), ("inductor", 9, True)])
def test_torch_compile_matches_the_loop(backend, length, reverse, rewrites):
    torch._dynamo.reset()
    body, h, a, b, w = _problem(length)
    compiled = torch.compile(_sqrt, backend=backend, fullgraph=True)  # the backward: AOTAutograd's
    assert_trees_close(_run(compiled, body, h, a, b, w, length, reverse), _want(length, reverse))
    assert rewrites == ([length] if length >= 2 else [])  # T < 2: one scan, nothing to split


def test_dynamic_lengths_stay_one_scan_and_match_the_loop(rewrites):
    torch._dynamo.reset()
    w = torch.randn(3, 3, requires_grad=True)

    def body(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    compiled = torch.compile(lambda h, xs: scan(body, h, xs, remat="sqrt"), backend="aot_eager", dynamic=True,
                             fullgraph=True)
    for length in (6, 11):
        h, xs = torch.randn(2, 3, requires_grad=True), torch.randn(length, 2, 3, requires_grad=True)
        got, want = compiled(h, xs), reference_scan(body, h, xs)
        assert_trees_close([*got, *torch.autograd.grad(sum(t.sum() for t in got), [h, xs, w])],
                           [*want, *torch.autograd.grad(sum(t.sum() for t in want), [h, xs, w])])
    assert rewrites == []  # a symbolic length is not cut into blocks


def test_export_is_two_scans_with_the_loop_values():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, h, xs):
            return scan(lambda c, x: (torch.tanh(self.lin(c) + x), c.sum()), h, xs, remat="sqrt", reverse=True)

    m, h, xs = M(), torch.randn(2, 4), torch.randn(11, 2, 4)  # k=4: 2 blocks of 4 and a tail of 3
    ep = torch.export.export(m, (h, xs))
    want = reference_scan(lambda c, x: (torch.tanh(m.lin(c) + x), c.sum()), h, xs, reverse=True)
    assert_trees_close(ep.module()(h, xs), want)
    outer = [n for n in ep.graph.nodes if n.target is torch.ops.higher_order.scan]
    assert len(outer) == 2  # the blocks' outer scan and the tail
    inner = [n for mod in ep.graph_module.modules() if mod is not ep.graph_module
             for n in getattr(getattr(mod, "graph", None), "nodes", ()) if n.target is torch.ops.higher_order.scan]
    assert inner  # one block of steps is a scan in the outer scan's body


@pytest.mark.parametrize("length,reverse,route", [(9, False, "dynamo"), (11, True, "make_fx")])
def test_xla_grads_match_the_loop(length, reverse, route, rewrites, monkeypatch):
    pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra")
    import torch_xla.core.xla_model as xm
    from xla_util import force_route

    force_route(monkeypatch, route)  # each eager route once (xla/eager.py)

    dev = xm.xla_device()
    body, h, a, b, w = _problem(length)
    want = _want(length, reverse)
    hx, ax, bx, wx = (t.detach().to(dev).requires_grad_() for t in (h, a, b, w))

    def body_x(c, x):
        h = torch.tanh(c["h"] @ wx + x["a"]) * (1 + x["b"].sum(-1, keepdim=True))
        return {"h": h, "n": c["n"] + 1}, (h.sum(-1), None)

    init = {"h": hx, "n": torch.zeros((), dtype=torch.int64, device=dev)}
    for _ in range(2):  # on Dynamo's route the second call runs on the guards
        c, ys = scan(body_x, init, {"a": ax, "b": bx}, dim=1, reverse=reverse, remat="sqrt")
        weights = torch.arange(1, length + 1, dtype=torch.float64, device=dev)[:, None]
        grads = torch.autograd.grad(c["h"].sum() + (ys[0] * weights).sum(), [hx, ax, bx, wx])
        assert_trees_close([None if t is None else t.cpu() for t in (c["h"], c["n"], *ys, *grads)], want)
    assert rewrites


def test_bad_input_is_the_same_scan_error_inside_the_nest(rewrites):
    def bad(c, x):
        return {"h": torch.cat([c["h"], x], -1)}, None

    with pytest.raises(ScanError, match=r"carry\['h'\] changed across an iteration: shape \(2, 6\) vs init's \(2, 3\)"):
        make_fx(lambda h, xs: scan(bad, {"h": h}, xs, remat="sqrt"))(torch.randn(2, 3), torch.randn(9, 2, 3))
    assert rewrites == [9]  # raised by the inner scan, naming the user's carry path
