"""A scan whose tensors are all on an accelerator counts its steps with two library
operators (``inductor/counter.py``), so that its graph builds no C++ kernel: on CUDA the
C++ toolchain's first use was ~50 s of a ~55 s first call. No GPU needed: the choice is
forced here on CPU tensors, and the loop must still give the loop's values and gradients."""
import pytest
import torch
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan
from torch_scan_hop.inductor import counter

from conftest import reference_scan


@pytest.fixture
def operators(monkeypatch):
    monkeypatch.setattr(counter, "uses_operators", lambda tensors: True)


def _body(w):
    return lambda c, x: (torch.tanh(c @ w + x), c.sum(-1))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_counted_by_operators_trains_as_the_loop(operators, fresh_dynamo, reverse, dynamic):
    w = (torch.randn(6, 6) * 0.3).requires_grad_()
    f = torch.compile(lambda w, c0, xs: scan(_body(w), c0, xs, reverse=reverse), dynamic=dynamic)
    for t in (5, 7):
        c0, xs = torch.randn(3, 6, requires_grad=True), torch.randn(t, 3, 6)
        (c, ys), codes = run_and_get_code(f, w, c0, xs)
        want = reference_scan(_body(w), c0, xs, reverse=reverse)
        torch.testing.assert_close((c, ys), want, atol=1e-5, rtol=1e-4)
        got = torch.autograd.grad(c.square().sum() + ys.sin().sum(), [w, c0])
        expect = torch.autograd.grad(want[0].square().sum() + want[1].sin().sum(), [w, c0])
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-4)
    forward = codes[0]
    assert "torch_scan_hop.loop_counter" in forward
    assert "torch.ops.torch_scan_hop.count_step.default(" not in forward  # a for loop's: dropped
    assert "count_step(" in forward


def test_cpu_scans_keep_the_generated_counter():
    assert not counter.uses_operators([torch.ones(2), torch.ones(2, device="meta")])
    assert counter.uses_operators([torch.ones(2, device="meta"), 3])
