"""A body that calls a higher-order op of its own (``torch.cond``, upstream's ``while_loop``) runs
eagerly on XLA, as it does under torch.compile: make_fx cannot trace such a body outside Dynamo
(the op compiles its own call, through scan's closure stand-ins), so its calls take Dynamo's
capture. Values (and gradients where the op has them) as the Python loop's on the CPU."""
import pytest
import torch
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import scan

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")

DEV = torch_xla.device()


def _cond_body(w):
    def body(c, x):
        c2 = torch.cond(c.sum() > 0, lambda v: torch.tanh(v @ w), lambda v: v * 0.5 - 0.1, (c,))
        return c2 + x, c2.sum(-1)
    return body


def _while_body(w):
    from torch._higher_order_ops.while_loop import while_loop

    def body(c, x):
        i0 = torch.zeros((), dtype=torch.int64, device=c.device)
        _, c2 = while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, torch.tanh(v @ w)), (i0, c))
        return c2 + x, c2.sum(-1)
    return body


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=g) * 0.5, torch.randn(2, 4, generator=g), torch.randn(6, 2, 4, generator=g)


@pytest.mark.parametrize("make_body", [_cond_body, _while_body], ids=["cond", "while_loop"])
def test_forward_as_the_loop(make_body):
    w, c0, xs = _inputs()
    want = reference_scan(make_body(w), c0, xs)
    with torch.no_grad():
        for _ in range(3):  # first call, capture, guarded calls
            got = scan(make_body(w.to(DEV)), c0.to(DEV), xs.to(DEV))
            assert_trees_close(tuple(t.cpu() for t in got), want, rtol=1e-5, atol=1e-5)


def test_cond_gradients_as_the_loop():
    w, c0, xs = _inputs()
    w.requires_grad_()
    c, ys = reference_scan(_cond_body(w), c0, xs)
    want = torch.autograd.grad(c.sum() + ys.sum(), w)
    for _ in range(2):
        wd = w.detach().to(DEV).requires_grad_()
        c, ys = scan(_cond_body(wd), c0.to(DEV), xs.to(DEV))
        (got,) = torch.autograd.grad(c.sum() + ys.sum(), wd)
        assert_trees_close(got.cpu(), want[0], rtol=1e-4, atol=1e-5)
