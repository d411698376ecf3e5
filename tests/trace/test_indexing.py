"""trace/indexing: reads at a 0-d integer tensor index (the step index of ``with_index=True``) in a
traced body: ``buf.select(dim, t)`` and ``buf.narrow(dim, t, n)`` as the loop computes them.

Both read ``t``'s value in torch (a data-dependent size or offset); traced, they are advanced
indexing. Strict export records Dynamo's graph as written, whose later fake run of ``select``
read ``t`` (a data-dependence ScanError), and ``narrow`` read it under make_fx too."""
import pytest
import torch
from conftest import assert_trees_close
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import ScanError, scan

D = torch.float64


def body(state, x, t):
    c, buf, tbuf = state
    r = buf.select(0, t) * 1.5 + buf.narrow(0, (t - 1) % 4, 1).squeeze(0)  # the row written a step before
    r = r + torch.select(tbuf, 1, t).transpose(0, 0) * 0.5
    buf.index_copy_(0, t.reshape(1), torch.tanh(c * x + r).unsqueeze(0))
    tbuf[:, t] = torch.tanh(c - r)
    return (torch.tanh(c + r), buf, tbuf), r.sum(-1)


class _Scan(torch.nn.Module):
    def forward(self, c, buf, tbuf, xs):
        return scan(body, (c, buf, tbuf), xs, with_index=True)


def _loop_of(step):
    """The Python loop of ``step`` over its carries and xs (the reference of each test)."""
    def loop(*args):
        *state, xs = args
        state, ys = tuple(state), []
        for i in range(xs.shape[0]):
            state, y = step(state, xs[i], torch.tensor(i))
            ys.append(y)
        return state, torch.stack(ys)
    return loop


def _loop(c, buf, tbuf, xs):
    return _loop_of(body)(c, buf, tbuf, xs)


def _args():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g, dtype=D) for s in [(2, 3), (4, 2, 3), (2, 4, 3), (3, 2, 3)])


def test_strict_export_reads_at_the_step_index():
    ep = torch.export.export(_Scan(), _args(), strict=True)
    assert_trees_close(ep.module()(*_args()), _loop(*_args()))


def test_make_fx_reads_at_the_step_index_gradients():
    """make_fx (fake) of the scan and its float64 gradients, against the loop's."""
    def grads(f, args):
        c, xs = args[0].requires_grad_(), args[3].requires_grad_()
        (c_out, buf, tbuf), ys = f(*args)
        loss = (c_out * 1.3).sum() + ys.sin().sum() + (buf * 0.7).sum() + tbuf.sum()
        return [c_out, ys, buf, tbuf, *torch.autograd.grad(loss, (c, xs))]

    gm = make_fx(_Scan(), tracing_mode="fake")(*_args())
    assert_trees_close(grads(gm, _args()), grads(_loop, _args()))


def _stale(state, x, t):
    c, buf = state
    r, s = buf[t], buf.select(0, (t + 1) % 4)  # views in the loop: they show the writes below
    buf[t] = torch.tanh(c * x)
    buf.index_copy_(0, ((t + 1) % 4).reshape(1), (c * 0.5).unsqueeze(0))
    return (c + r + s * 0.5, buf), r * 2  # (no op saving r or s: the loop's backward would fail)


def test_a_read_used_after_a_write_into_its_tensor_shows_the_write():
    """``r = buf[t]; buf[t] = h; use(r)``: traced, ``r`` is a copy, and held the row before the write
    where the loop's view holds ``h`` (a silent wrong number): it is read again once ``buf`` was written.
    make_fx (fake): values and float64 gradients against the loop."""
    def grads(f, c, buf, xs):
        c, xs = c.requires_grad_(), xs.requires_grad_()
        (c_out, buf), ys = f(c, buf, xs)
        loss = (c_out * 1.3).sum() + ys.sin().sum() + (buf * 0.7).sum()
        return [c_out, ys, buf, *torch.autograd.grad(loss, (c, xs))]

    def ours(c, buf, xs):
        return scan(_stale, (c, buf), xs, with_index=True)

    args = lambda: [a for i, a in enumerate(_args()) if i != 2]  # noqa: E731
    gm = make_fx(ours, tracing_mode="fake")(*args())
    assert_trees_close(grads(gm, *args()), grads(_stale_loop, *args()))


def _stale_loop(c, buf, xs):
    return _loop_of(_stale)(c, buf, xs)


def test_a_read_used_after_a_write_shows_it_under_strict_export():
    """The same under Dynamo (strict export): its graph records the body as written, the reads done
    again by the graph pass (``rewrite_graph_indexing``)."""
    class Stale(torch.nn.Module):
        def forward(self, c, buf, xs):
            return scan(_stale, (c, buf), xs, with_index=True)

    args = lambda: [a for i, a in enumerate(_args()) if i != 2]  # noqa: E731
    ep = torch.export.export(Stale(), tuple(args()), strict=True)
    assert_trees_close(ep.module()(*args()), _stale_loop(*args()))


def _viewed(state, x, t):
    c, buf, cols = state
    r = buf[t].unsqueeze(0)  # the loop's: views of buf, showing the writes below
    s = buf.select(0, (t + 1) % 4).t().expand(2, 3, 2)
    k = cols[:, t].reshape(-1)  # the loop's: a copy (the column is not contiguous), the row before the write
    buf[t] = torch.tanh(c * x)
    buf.index_copy_(0, ((t + 1) % 4).reshape(1), (c * 0.5).unsqueeze(0))
    cols[:, t] = torch.tanh(c - x)
    return (c + r.squeeze(0) + s[1].t() * 0.5 + k.view(2, 3) * 0.3, buf, cols), r.sum(-1) * 2 + k.sum()


def _viewed_loop(c, buf, cols, xs):
    return _loop_of(_viewed)(c, buf, cols, xs)


def _viewed_scan(c, buf, cols, xs):
    return scan(_viewed, (c, buf, cols), xs, with_index=True)


def _viewed_grads(f, c, buf, cols, xs):
    c, xs = c.requires_grad_(), xs.requires_grad_()
    (c_out, buf, cols), ys = f(c, buf, cols, xs)
    loss = (c_out * 1.3).sum() + ys.sin().sum() + (buf * 0.7).sum() + cols.sum()
    return [c_out, ys, buf, cols, *torch.autograd.grad(loss, (c, xs))]


def test_a_view_of_a_read_taken_before_a_write_shows_it():
    """``r = buf[t].unsqueeze(0); buf[t] = h; use(r)``: the loop's ``r`` is a view of ``buf`` (it holds
    ``h``); traced, the view of the read's copy held the old row (a silent wrong number): it is made
    again from the read done again. ``cols[:, t].reshape(-1)`` is the loop's copy (a column is not
    contiguous) and keeps the old row. make_fx (fake): values and float64 gradients against the loop."""
    gm = make_fx(_viewed_scan, tracing_mode="fake")(*_args())
    assert_trees_close(_viewed_grads(gm, *_args()), _viewed_grads(_viewed_loop, *_args()))


def test_a_view_of_a_read_shows_the_write_compiled_and_under_vmap():
    """The same compiled (Dynamo's graph, ``rewrite_graph_indexing``), values and gradients, and a
    compiled vmap of the scan (the graph's example values are batched: compared by their batched
    storage), against the loop's vmap."""
    torch._dynamo.reset()
    got = _viewed_grads(torch.compile(_viewed_scan, backend="aot_eager", fullgraph=True), *_args())
    assert_trees_close(got, _viewed_grads(_viewed_loop, *_args()))
    batch = [torch.stack([a, a * 0.5]) for a in _args()]
    torch._dynamo.reset()
    got = torch.compile(torch.vmap(_viewed_scan), backend="aot_eager")(*[a.clone() for a in batch])
    assert_trees_close(got, torch.vmap(_viewed_loop)(*[a.clone() for a in batch]))


def test_a_view_the_loop_cannot_take_used_after_a_write_is_a_scan_error():
    """``cols[:, t].view(-1)``: the loop's ``view`` of a column fails; traced, the read is a contiguous
    copy whose view works, and whether the loop's value would show the write cannot be told: a
    ScanError naming the view, never the old row."""
    def body(state, x, t):
        c, cols = state
        k = cols[:, t].view(-1)
        cols[:, t] = torch.tanh(c * x)
        return (c + k.view(2, 3), cols), k.sum()

    args = _args()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        body((args[0], args[2]), args[3][0], torch.tensor(0))
    with pytest.raises(ScanError, match=r"a view of the read \(view\).*used after a write"):
        make_fx(lambda c, cols, xs: scan(body, (c, cols), xs, with_index=True), tracing_mode="fake")(
            args[0], args[2], args[3])
