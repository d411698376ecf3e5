"""``scan(..., with_index=True)``: ``fn(carry, x, i)`` with the step index as a 0-d int64 tensor,
on every path (eager, make_fx, torch.compile aot_eager and inductor, XLA), against the Python
loop over ``range(T)`` / ``reversed(range(T))``: values and gradients."""
import pytest
import torch
from conftest import assert_trees_close
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import ScanError, scan

D = torch.float64


def body(carry, x, i):
    h = torch.tanh(carry * 0.9 + x * (i + 1))
    return h, {"h": h * i, "i": i}


def loop(fn, init, xs, n, reverse):
    carry, ys = init, [None] * n
    for i in (reversed(range(n)) if reverse else range(n)):
        carry, ys[i] = fn(carry, None if xs is None else xs[i], torch.tensor(i))
    return carry, torch.utils._pytree.tree_map(lambda *c: torch.stack(c), *ys)


def inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)
    init = torch.randn(2, 3, dtype=D, generator=g).to(device).requires_grad_()
    xs = torch.randn(5, 2, 3, dtype=D, generator=g).to(device).requires_grad_()
    return init, xs


def with_grads(out, leaves):
    total = sum((t * (k + 1.5)).sum() for k, t in enumerate(torch.utils._pytree.tree_leaves(out))
                if t.is_floating_point())
    return out, torch.autograd.grad(total, leaves)


def compiled(backend):
    return lambda f: torch.compile(f, backend=backend, fullgraph=True)


def traced(f):
    return lambda *a: make_fx(f)(*a)(*a)


PATHS = {"eager": lambda f: f, "make_fx": traced, "aot_eager": compiled("aot_eager"), "inductor": compiled("inductor")}


@pytest.mark.parametrize("path,reverse", [(p, r) for p in PATHS for r in (False, True)
                                          if p in ("eager", "make_fx") or r])  # compiles cost seconds
def test_index_matches_loop(path, reverse):
    init, xs = inputs()
    got = PATHS[path](lambda c, x: scan(body, c, x, reverse=reverse, with_index=True))(init, xs)
    assert_trees_close(with_grads(got, (init, xs)), with_grads(loop(body, init, xs, 5, reverse), (init, xs)))
    assert got[1]["i"].dtype == torch.int64


@pytest.mark.parametrize("path", ["eager", "make_fx"])
def test_index_without_xs(path):
    def count(c, x, i):
        assert x is None
        return c + i * c.new_ones(()), i
    init = torch.tensor(1.0, dtype=D, requires_grad=True)
    got = PATHS[path](lambda c: scan(count, c, length=4, reverse=True, with_index=True))(init)
    assert_trees_close(with_grads(got, (init,)), with_grads(loop(count, init, None, 4, True), (init,)))


def test_index_with_dim_and_pytree_xs():
    init, xs = inputs()
    tree = {"a": xs.transpose(0, 1), "b": None}
    got = scan(lambda c, x, i: body(c, x["a"], i), init, tree, dim=1, with_index=True)
    assert_trees_close(got, loop(body, init, xs, 5, False))


def test_with_index_must_be_a_bool():
    with pytest.raises(ScanError, match="with_index must be a bool"):
        scan(body, torch.zeros(2), torch.zeros(3, 2), with_index=1)


@pytest.mark.parametrize("route", ["make_fx", "dynamo"])
def test_index_on_xla(route, monkeypatch):
    torch_xla = pytest.importorskip("torch_xla")
    from xla_util import force_route

    force_route(monkeypatch, route)  # each eager route (xla/eager.py)
    dev = torch_xla.device()
    init, xs = inputs()
    want = with_grads(loop(body, init, xs, 5, True), (init, xs))
    for _ in range(2):  # on Dynamo's route the second call runs on the guards
        init, xs = inputs(dev)
        got = with_grads(scan(body, init, xs, reverse=True, with_index=True), (init, xs))
        assert_trees_close(torch.utils._pytree.tree_map(lambda t: t.cpu(), got), want)


def _indexing_body(carry, x, i):
    h, buf = carry
    prev = buf[(i - 1) % buf.shape[0]] * 0.5 + buf.select(0, i)  # the row the step before wrote, and row i
    buf[i] = torch.tanh(h * 0.9 + x + prev)
    return (h + buf[i], buf), buf.select(0, i) * 2


def test_make_fx_real_of_a_transform_indexing_by_the_step_index():
    """make_fx (real mode, its default) of torch.func.grad of a scan reading and writing ``buf[i]``:
    the transform runs the loop unrolled into the trace, where ``i`` (a slice of a traced arange) has no
    value to read (make_fx: "trying to get value out of a tracing tensor"): it indexes as on the traced
    paths. The traced graph's float64 derivatives against the same transform of the loop."""
    def f(fn):
        def run(h0, xs):
            (h, buf), ys = fn(_indexing_body, (h0, torch.zeros(5, 2, 3, dtype=D)), xs)
            return (h * 1.3).sum() + ys.sin().sum() + buf.sum()
        return run

    def apply(g, h0, xs):
        return torch.func.grad(g, argnums=(0, 1))(h0, xs)
    h0, xs = (t.detach() for t in inputs())
    gm = make_fx(lambda h0, xs: apply(f(lambda fn, init, xs: scan(fn, init, xs, with_index=True)), h0, xs))(h0, xs)
    want = apply(f(lambda fn, init, xs: loop(fn, init, xs, 5, False)), h0, xs)
    assert_trees_close(gm(h0, xs), want)
