"""The buffers a compiled scan's counted loop allocates every iteration come from two per
allocation line, allocated once (``_compat.inductor_loop.pool_loop_buffers``): the rewrite of
the generated code, and compiled training steps against the Python loop."""
import pytest
import torch
from conftest import reference_scan
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan
from torch_scan_hop._compat.inductor_loop import pool_loop_buffers

LOOP = """\
        buf5 = [buf1, buf0, primals_2]
        for buf5_step in range({n}):
            # subgraph: body
            b_arg0_1 = buf5[0]
            b_arg1_1 = buf5[1]
            b_arg2_1 = buf5[2]
            u3 = buf5_step
            b_buf5 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
            kernel(b_arg2_1, out=b_buf5)
            b_buf6 = b_buf5; del b_buf5  # reuse
            b_buf7 = empty_strided_cpu((4096, 512), (512, 1), torch.float32)
            kernel(b_buf7, b_buf6)
            del b_buf7
            buf5[0] = b_arg0_1
            buf5[1] = {second}
            buf5[2] = b_buf6
        buf9 = buf5[2]"""


def test_allocations_come_from_two_buffers_per_line():
    code = pool_loop_buffers(LOOP.format(n=16, second="b_arg1_1"))
    lines = code.split("\n")
    assert len(lines) == len(LOOP.split("\n"))  # inductor's line map stays right
    assert lines[0] == ("        buf5 = [buf1, buf0, primals_2]; buf5_pool0 = (empty_strided_cpu((8, 64), (64, 1), "
                        "torch.float32), empty_strided_cpu((8, 64), (64, 1), torch.float32),)")
    assert "            b_buf5 = buf5_pool0[buf5_step & 1]" in lines
    # 8 MiB: allocated each iteration as before (the kernels filling it cost far more)
    assert "            b_buf7 = empty_strided_cpu((4096, 512), (512, 1), torch.float32)" in lines


def test_one_iteration_takes_one_buffer():
    code = pool_loop_buffers(LOOP.format(n=1, second="b_arg1_1"))
    assert "b_buf5 = buf5_pool0[0]" in code and code.count("empty_strided_cpu((8, 64)") == 1


@pytest.mark.parametrize("second", ["b_arg2_1", "b_view", "b_buf0"])
def test_outputs_that_could_outlive_an_iteration_leave_the_loop_alone(second):
    """A carried input leaving at another position (here the carry at 2 becomes the carry
    at 1: ``(a, b) -> (b, ...)``) keeps a buffer two iterations; a view or another
    kernel's result cannot be traced to an allocation."""
    code = LOOP.format(n=16, second=second)
    assert pool_loop_buffers(code) == code


def _rnn(w):
    def cell(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)
    return cell


def _swap(w):
    """(a, b) -> (b, tanh(a @ w + b + x)): a carried input leaves at another position."""
    def cell(carry, x):
        a, b = carry
        return (b, torch.tanh(a @ w + b + x)), a.sum(-1)
    return cell


@pytest.mark.parametrize("body", ["rnn", "swap"])
def test_compiled_training_step_matches_the_loop(body):
    torch.manual_seed(0)
    make = _rnn if body == "rnn" else _swap

    def loss(run, w, c, xs):
        init = c if body == "rnn" else (c, c * 0.5)
        carry, ys = run(make(w), init, xs)
        return sum(t.square().sum() for t in (carry if isinstance(carry, tuple) else (carry,))) + ys.sum()

    def grads(fn):
        w = (torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.3)
        c = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        xs = torch.randn(7, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        leaves = [t.requires_grad_() for t in (w, c, xs)]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    compiled = torch.compile(lambda w, c, xs: loss(scan, w, c, xs), backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(grads, compiled)
    want = grads(lambda w, c, xs: loss(reference_scan, w, c, xs))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)
    code = "\n".join(codes)
    assert code.count("_step in range(7):") == 2
    if body == "rnn":  # forward and backward loops both take their buffers from pools
        assert code.count("_pool0[") == 2, code[-4000:]
