"""trace/closures: the stand-ins a traced body reads for the tensors it closes over.

On XLA every tensor is a functional wrapper, read through a stand-in that requires grad when the
closure does: a body writing into a closure with a history (``buf = base.clone()``, which the loop
may write) wrote into that stand-in, a leaf, and the scan refused it ("fn mutates its input").
"""
import pytest
import torch
from conftest import assert_trees_close

from torch_scan_hop import scan

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed")
DEV = torch_xla.device()


def _body(buf):
    def body(c, x, t):
        prev = buf[(t - 1) % buf.shape[0]].clone()  # the row the previous step wrote: gradients flow through it
        buf.index_copy_(0, t.reshape(1), (c * x + prev).unsqueeze(0))
        return torch.tanh(c + buf[t] * 0.5), buf.select(0, t) * 1.5
    return body


def _run(device, use_scan):
    g = torch.Generator().manual_seed(0)
    c0, xs, b0 = (torch.randn(*s, generator=g, dtype=torch.float64) for s in [(2, 3), (3, 2, 3), (4, 2, 3)])
    c0, xs, base = (t.to(device).requires_grad_() for t in (c0, xs, b0))
    buf = base.clone()  # no leaf: the loop writes into it
    if use_scan:
        out = scan(_body(buf), c0, xs, with_index=True)
    else:
        c, ys = c0, []
        for i in range(xs.shape[0]):
            c, y = _body(buf)(c, xs[i], torch.tensor(i, device=device))
            ys.append(y)
        out = c, torch.stack(ys)
    loss = (out[0] * 1.3).sum() + (out[1].sin()).sum() + (buf * 0.7).sum()  # the buffer after, too
    grads = torch.autograd.grad(loss, (c0, xs, base))
    return [t.detach().cpu() for t in (*out, buf, *grads)]


def test_xla_write_into_a_closure_that_requires_grad_matches_the_loop():
    """Values, float64 gradients (to the buffer's base) and the buffer's contents after, as the loop."""
    want = _run("cpu", use_scan=False)
    assert_trees_close(_run(DEV, use_scan=True), want)
