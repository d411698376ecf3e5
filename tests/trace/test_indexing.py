"""trace/indexing: reads at a 0-d integer tensor index (the step index of ``with_index=True``) in a
traced body: ``buf.select(dim, t)`` and ``buf.narrow(dim, t, n)`` as the loop computes them.

Both read ``t``'s value in torch (a data-dependent size or offset); traced, they are advanced
indexing. Strict export records Dynamo's graph as written, whose later fake run of ``select``
read ``t`` (a data-dependence ScanError), and ``narrow`` read it under make_fx too."""
import torch
from conftest import assert_trees_close
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import scan

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


def _loop(c, buf, tbuf, xs):
    state, ys = (c, buf, tbuf), []
    for i in range(xs.shape[0]):
        state, y = body(state, xs[i], torch.tensor(i))
        ys.append(y)
    return state, torch.stack(ys)


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
    state, ys = (c, buf), []
    for i in range(xs.shape[0]):
        state, y = _stale(state, xs[i], torch.tensor(i))
        ys.append(y)
    return state, torch.stack(ys)


def test_a_read_used_after_a_write_shows_it_under_strict_export():
    """The same under Dynamo (strict export): its graph records the body as written, the reads done
    again by the graph pass (``rewrite_graph_indexing``)."""
    class Stale(torch.nn.Module):
        def forward(self, c, buf, xs):
            return scan(_stale, (c, buf), xs, with_index=True)

    args = lambda: [a for i, a in enumerate(_args()) if i != 2]  # noqa: E731
    ep = torch.export.export(Stale(), tuple(args()), strict=True)
    assert_trees_close(ep.module()(*args()), _stale_loop(*args()))
