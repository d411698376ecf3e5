"""Caching never changes a result: eager scan caches nothing, and the traced
path reuses a partition only for an identical joint graph."""
import contextlib
import linecache

import pytest
import torch
from conftest import assert_trees_close, reference_scan

import torch_scan_hop
from torch_scan_hop import _compat
from torch_scan_hop.trace import cache as _cache
from torch_scan_hop import scan

D = torch.float64
_FLAG = 1.0


@pytest.fixture(autouse=True)
def _fresh_cache():
    torch_scan_hop.clear_cache()
    yield
    torch_scan_hop.clear_cache()


def grads_of(fn, init, xs, params):
    carry, ys = fn(init, xs)
    loss = carry.pow(2).sum() + ys.sin().sum()
    return [carry, ys, *torch.autograd.grad(loss, params)]


class CountingPartition:
    """A remat policy (the traced path) that counts how often it partitions."""

    def __init__(self):
        from functorch.compile import default_partition

        self.calls, self.inner = 0, default_partition

    def __call__(self, joint, inputs, *, num_fwd_outputs):
        self.calls += 1
        return self.inner(joint, inputs, num_fwd_outputs=num_fwd_outputs)


@pytest.mark.parametrize("grad", [False, True])
def test_eager_runs_the_body_once_per_step_every_call(grad):
    w = torch.randn(3, 3, dtype=D, requires_grad=grad)
    calls = []

    def body(c, x):
        calls.append(1)
        return torch.tanh(c @ w + x), c.sum(-1)

    for n in (5, 5, 3):
        calls.clear()
        scan(body, torch.randn(2, 3, dtype=D), torch.randn(n, 2, 3, dtype=D))
        assert len(calls) == n


def test_identical_joint_reuses_the_partition_and_a_new_one_is_built():
    global _FLAG
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    part = CountingPartition()
    init, xs = torch.randn(2, 3, dtype=D), torch.randn(4, 2, 3, dtype=D)

    def body(c, x):  # reads a global: only the traced graph can tell it changed
        return torch.tanh(c @ w * _FLAG + x), c.sum(-1)

    def run():
        return grads_of(lambda i, x: scan(body, i, x, remat=part), init, xs, [w])

    def want():
        return grads_of(lambda i, x: reference_scan(body, i, x), init, xs, [w])

    try:
        for flag, partitions in ((1.0, 1), (1.0, 1), (2.0, 2), (-0.0, 3), (0.0, 4), (2.0, 4)):
            _FLAG = flag
            assert_trees_close(run(), want())
            assert part.calls == partitions, (flag, part.calls)
    finally:
        _FLAG = 1.0


def test_module_state_changes_between_calls_are_seen_on_the_traced_path():
    class Cell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 3, dtype=D))
            self._scale = 1.0

        @property
        def scale(self):
            return self._scale

        def forward(self, c, x):
            h = torch.tanh(c @ self.w * self.scale + x)
            return h, h.sum(-1)

    cell, part = Cell(), CountingPartition()
    init, xs = torch.randn(2, 3, dtype=D), torch.randn(4, 2, 3, dtype=D)
    for scale in (1.0, 3.0):
        cell._scale = scale
        got = grads_of(lambda i, x: scan(cell, i, x, remat=part), init, xs, [cell.w])
        assert_trees_close(got, grads_of(lambda i, x: reference_scan(cell, i, x), init, xs, [cell.w]))
    handle = cell.register_forward_hook(lambda m, args, out: (out[0] * 2, out[1]))
    try:
        got = grads_of(lambda i, x: scan(cell, i, x, remat=part), init, xs, [cell.w])
        assert_trees_close(got, grads_of(lambda i, x: reference_scan(cell, i, x), init, xs, [cell.w]))
    finally:
        handle.remove()


def test_tensor_read_as_python_value_and_updated_in_place():
    flag = torch.tensor(True)
    w = torch.randn(3, dtype=D, requires_grad=True)
    body = lambda c, x: ((c * w if bool(flag) else c - w) + x, c.sum())  # noqa: E731
    init, xs = torch.randn(3, dtype=D), torch.randn(4, 3, dtype=D)
    part = CountingPartition()
    for value in (True, False, True):
        flag.fill_(value)
        want = grads_of(lambda i, x: reference_scan(body, i, x), init, xs, [w])
        assert_trees_close(grads_of(lambda i, x: scan(body, i, x), init, xs, [w]), want)
        # traced: the closure's value is read at trace time, and the body is traced every call
        assert_trees_close(grads_of(lambda i, x: scan(body, i, x, remat=part), init, xs, [w]), want)


def test_data_dependent_control_flow_on_the_carry_is_a_clear_error_when_traced():
    body = lambda c, x: (c + x if c.sum() > 0 else c - x, None)  # noqa: E731
    init, xs = torch.ones(3, dtype=D, requires_grad=True), torch.randn(4, 3, dtype=D)
    assert_trees_close(scan(body, init, xs), reference_scan(body, init, xs))  # eager: the loop
    with pytest.raises(torch_scan_hop.ScanError, match="reads the value of a tensor"):
        scan(body, init, xs, remat=CountingPartition())


def test_graph_key_sees_constants_and_signed_zero():
    from torch.fx.experimental.proxy_tensor import make_fx

    def key_of(fn):
        return _cache.graph_key(make_fx(fn)(torch.ones(3)))[0]

    assert key_of(lambda x: x * 0.0) != key_of(lambda x: x * -0.0)
    assert key_of(lambda x: x + torch.tensor([1.0, 2.0, 3.0])) != key_of(lambda x: x + torch.tensor([1.0, 2.0, 4.0]))
    assert key_of(lambda x: x + torch.tensor([1.0, 2.0, 3.0])) == key_of(lambda x: x + torch.tensor([1.0, 2.0, 3.0]))
    assert key_of(lambda x: x.sin()) != key_of(lambda x: x.cos())


def test_a_joints_key_skips_detach_and_alias_only():
    """A joint is keyed by its values (``plan_for(keyed_by="joint")``): a detach there changes
    nothing, so the make_fx route's joint (closures read through detaches) and Dynamo's of the
    same body share a plan; any other op still tells graphs apart."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def key_of(fn, values_only):
        return _cache.graph_key(make_fx(fn)(torch.ones(3), torch.ones(3)), values_only=values_only)[0]

    plain, detached = (lambda x, w: x * w), (lambda x, w: x * w.detach().detach())
    assert key_of(plain, False) != key_of(detached, False)
    assert key_of(plain, True) == key_of(detached, True)
    assert key_of(plain, True) != key_of(lambda x, w: x * w.neg(), True)
    assert key_of(plain, True) != key_of(lambda x, w: w * x, True)


def test_graph_key_of_a_module_follows_its_recompiled_graph_and_its_tensors():
    """graph_key remembers the key of a flat graph per module: an edited, recompiled graph
    and a get_attr tensor changed in place still give new keys."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: x.sin() + 1)(torch.ones(3))
    before = _cache.graph_key(gm)[0]
    assert _cache.graph_key(gm)[0] == before  # remembered
    sin = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sin.default)
    sin.target = torch.ops.aten.cos.default
    gm.recompile()
    assert _cache.graph_key(gm)[0] != before

    big = torch.ones(5000)  # over _SMALL_CONSTANT: keyed by identity and version, not value
    gm = make_fx(lambda x: x + big)(torch.ones(5000))
    before = _cache.graph_key(gm)[0]
    gm._tensor_constant0.add_(1)  # make_fx's name for the closed-over tensor
    assert _cache.graph_key(gm)[0] != before


def test_traced_path_does_not_grow_linecache_without_bound(monkeypatch):
    from torch_scan_hop.core import trace_lock

    monkeypatch.setattr(trace_lock, "_MAX_OUR_SOURCES", 10)
    # graphs made with their code (ours are lazy: written only when a graph is run or printed)
    monkeypatch.setattr(_compat.tracing, "lazy_graph_modules", contextlib.nullcontext)
    monkeypatch.setattr(_compat.tracing, "lazy_graph_module", torch.fx.GraphModule)
    part = CountingPartition()
    init, xs = torch.randn(2, 3), torch.randn(3, 2, 3)

    def call():
        lin = torch.nn.Linear(3, 3)  # a fresh module every call
        carry, _ = scan(lambda c, x: (torch.tanh(lin(c) + x), None), init, xs, remat=part)
        carry.sum().backward()

    from torch.fx import graph_module

    call()
    per_call = graph_module._loader.next_id
    call()
    per_call = graph_module._loader.next_id - per_call
    assert per_call > 0  # each traced call compiles graphs...
    for _ in range(10):
        call()
    before = len(linecache.cache)
    for _ in range(30):
        call()
    assert len(linecache.cache) - before <= 10 < 30 * per_call  # ...but only the newest 10 are kept


def test_a_graph_body_reuses_its_plan_with_no_trace(monkeypatch):
    """A graph body with no user function behind it (Dynamo's) is differentiated
    as it is: an identical graph needs no trace of its joint to find its plan."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_scan_hop.op.hop import scan_op
    from torch_scan_hop.trace import graph as trace_graph_module

    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    body = make_fx(lambda c, x, w: [torch.tanh(c @ w + x), c.sum(-1)])(
        torch.zeros(2, 3, dtype=D), torch.zeros(2, 3, dtype=D), w.detach())
    traces, real = [], trace_graph_module.trace_aten_graph
    monkeypatch.setattr(trace_graph_module, "trace_aten_graph", lambda *a, **k: traces.append(1) or real(*a, **k))
    part = CountingPartition()
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        init, xs = torch.randn(2, 3, dtype=D, generator=gen), torch.randn(4, 2, 3, dtype=D, generator=gen)
        got = grads_of(lambda i, x: tuple(scan_op(body, [i], [x], (w,), remat=part)), init, xs, [w])
        want = grads_of(lambda i, x: reference_scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), i, x),
                        init, xs, [w])
        assert_trees_close(got, want)
        if seed == 0:
            assert traces
            traces.clear()
    assert part.calls == 1 and not traces


def test_graph_key_memo_lets_the_module_die():
    import gc
    import weakref

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: x.sin())(torch.ones(3))
    _cache.graph_key(gm)
    dead = weakref.ref(gm)
    del gm
    gc.collect()
    assert dead() is None
