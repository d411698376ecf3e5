"""trace/closure_writes (and the stand-ins of trace/closures): a body writing into a tensor it
closes over, in scans nested in a scan's body, traced by make_fx's fake and symbolic modes.

``remat="sqrt"`` traces as nested scans (blocks of steps), and a body may run a scan itself: each
scan finds the writes in its own body's graph and carries the tensor. The outer body's stand-in
mode also saw the nested body's ops and stood in again for the nested body's stand-in: the nested
scan then carried a tensor the body never names, found the writes again on every trace (fuzz seed
8058: a RecursionError after ~10 min, then a ScanError). Values, gradients (float64) and the
buffer's contents after the scan are compared with the Python loop.
"""
import pytest
import torch
from conftest import assert_trees_close, reference_scan
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import ScanError, scan

D = torch.float64
BLOCKS, K = 2, 3
T = BLOCKS * K


def _step(buf, c, x, t):
    buf[t] = torch.tanh(c + x)  # the loop's write into the closed-over buffer, row t
    c = c * 0.5 + buf[t] * 2 + buf[(t - 1) % T].sum() * 0.1  # and a read of the row the last step wrote
    return c, c * 3


def _sqrt(buf, c0, xs, reverse):
    return scan(lambda c, x, t: _step(buf, c, x, t), c0, xs, remat="sqrt", with_index=True, reverse=reverse)


def _nested(buf, c0, xs, reverse):
    """An outer scan over blocks whose body scans the block's K steps."""
    def block(c, xb):
        return scan(lambda c, xt: _step(buf, c, *xt), c, xb, reverse=reverse)

    c, ys = scan(block, c0, (xs.reshape(BLOCKS, K, 3), torch.arange(T).reshape(BLOCKS, K)), reverse=reverse)
    return c, ys.flatten(0, 1)


def _loop(buf, c0, xs, reverse):
    return reference_scan(lambda c, xt: _step(buf, c, *xt), c0, (xs, torch.arange(T)), reverse=reverse)


def _outputs(run, c0, xs, base, reverse):
    buf = base.clone()  # no leaf: the loop writes into it, and gradients reach base through it
    c, ys = run(buf, c0, xs, reverse)
    loss = (c * torch.arange(1.0, 4.0, dtype=D)).sum() + (ys.sin() * 0.3).sum() + (buf * buf).sum()
    return [c, ys, buf.clone(), *torch.autograd.grad(loss, (c0, xs, base))]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("run", [_sqrt, _nested], ids=["sqrt", "nested"])
@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_nested_scans_writing_a_closed_over_buffer_give_the_loops_values(tracing_mode, run, reverse):
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=g, dtype=D, requires_grad=True) for s in [(3,), (T, 3), (T, 3)]]
    gm = make_fx(lambda *a: _outputs(run, *a, reverse), tracing_mode=tracing_mode)(*args)
    got, want = gm(*args), _outputs(_loop, *args, reverse)
    assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


def _block(buf, c, xb, steps):
    """An outer step that writes the buffer before and after its K steps (``steps``: a scan or the loop)."""
    x, tb = xb
    buf[tb[0]] = buf[tb[0]] * 0.5 + c
    c, ys = steps(lambda c, xt: _step(buf, c, *xt), c, (x, tb))
    buf.mul_(0.9)
    return c + buf.sum(0), ys


def _both_levels(steps, outer):
    def run(buf, c0, xs, reverse):
        blocks = (xs.reshape(BLOCKS, K, 3), torch.arange(T).reshape(BLOCKS, K))
        c, ys = outer(lambda c, xb: _block(buf, c, xb, steps), c0, blocks)
        return c, ys.flatten(0, 1)
    return run


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_a_buffer_written_by_both_levels_holds_what_the_loop_leaves(tracing_mode):
    """The outer body writes the buffer before and after its nested scan writes it: the outer scan
    carries it, and the nested one carries the outer body's carried value."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(*s, generator=g, dtype=D, requires_grad=True) for s in [(3,), (T, 3), (T, 3)]]
    gm = make_fx(lambda *a: _outputs(_both_levels(scan, scan), *a, False), tracing_mode=tracing_mode)(*args)
    got, want = gm(*args), _outputs(_both_levels(reference_scan, reference_scan), *args, False)
    assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_a_nested_write_into_a_leaf_that_requires_grad_is_refused_as_the_loop_refuses_it(tracing_mode):
    base = torch.randn(T, 3, dtype=D, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        _loop(base, torch.randn(3, dtype=D), torch.randn(T, 3, dtype=D), False)
    with pytest.raises(ScanError, match="mutates its input in place"):
        make_fx(lambda c0, xs, buf: _nested(buf, c0, xs, False), tracing_mode=tracing_mode)(
            torch.randn(3, dtype=D), torch.randn(T, 3, dtype=D), base)
