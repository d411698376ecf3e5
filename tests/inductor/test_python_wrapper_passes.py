"""The buffers a compiled scan's counted loop allocates every iteration come from two per
allocation line, allocated once (``inductor.codegen.python_text.pool_loop_buffers``), and its counter
gets no kernel of its own (``drop_counter_inits``): the rewrites of the generated code, and
compiled steps against the Python loop."""
import pytest
import torch
from conftest import reference_scan
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan
from torch_scan_hop.inductor.codegen.python_text import drop_counter_inits, pool_loop_buffers, release_finished_loops

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


ONE_STORE = "k0 = async_compile.cpp_pybinding(['int64_t*'], '''\nextern void kernel(int64_t* out_ptr0) {}\n''')"
COUNTED = """\
        buf3 = empty_strided_cpu((), (), torch.int64)
        k0({arg})
        buf5 = [buf3, buf0]
        for buf5_step in range(4):
            buf5[0] = buf5[0]"""


@pytest.mark.parametrize("raw", [False, True], ids=["torch2.9", "torch2.15"])  # 2.15 writes the source r'''...'''
def test_a_kernel_that_only_sets_a_for_loops_counter_is_not_built(raw):
    one_store = ONE_STORE.replace("], '", "], r'") if raw else ONE_STORE
    code = drop_counter_inits(one_store + "\n" + COUNTED.format(arg="buf3"))
    lines = code.split("\n")
    assert len(lines) == len((one_store + "\n" + COUNTED).split("\n"))  # the line map holds
    assert "async_compile" not in code and lines[0].startswith("k0 = (['int64_t*'], ")
    assert "        pass  # k0(buf3): a for loop's counter, never read" in lines


@pytest.mark.parametrize("extra", ["        k0(buf0)", "        other = k0"])
def test_a_kernel_used_for_anything_else_stays(extra):
    code = ONE_STORE + "\n" + COUNTED.format(arg="buf3") + "\n" + extra
    assert drop_counter_inits(code) == code


def test_a_counter_without_a_for_loop_keeps_its_kernel():
    code = ONE_STORE + "\n" + COUNTED.format(arg="buf3").replace("for buf5_step in range(4):", "while True:")
    assert drop_counter_inits(code) == code


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_forward_builds_no_counter_kernel(dynamic):
    """Static and dynamic lengths (``range(5)``, ``range(s0)``): the for loop's counter gets no
    kernel. Both against the loop, two lengths each."""
    torch._dynamo.reset()
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 0.3
    body = lambda c, x: (torch.tanh(c @ w + x), c.sum(-1))  # noqa: E731
    compiled = torch.compile(lambda c, xs: scan(body, c, xs), fullgraph=True, dynamic=dynamic)
    for length in (5, 9):
        c0, xs = torch.randn(2, 8), torch.randn(length, 2, 8)
        got, codes = run_and_get_code(compiled, c0, xs)
        want = reference_scan(body, c0, xs)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        if codes:
            code = "\n".join(codes)
            assert "a for loop's counter, never read" in code, code[-3000:]


NESTED = """\
        buf4 = [buf3, buf1, primals_1]
        for buf4_step in range(3):
            # subgraph: body
            b_arg0_1 = buf4[0]
            b_arg1_1 = buf4[1]
            b_arg2_1 = buf4[2]
            u2 = buf4_step
            b_buf6 = empty_strided_cpu((5, 8, 32), (256, 32, 1), torch.float32)
            b_buf9 = [b_arg0_1, b_buf6, b_arg2_1]
            for b_buf9_step in range(5):
                c_arg0_1 = b_buf9[0]
                c_arg1_1 = b_buf9[1]
                c_buf5 = empty_strided_cpu((8, 32), (32, 1), torch.float32)
                c_buf6 = c_buf5; del c_buf5  # reuse
                kernel(c_arg1_1, c_buf6)
                b_buf9[0] = c_arg0_1
                b_buf9[2] = c_buf6
            del b_buf6
            b_buf14 = b_buf9[2]
            kernel(b_buf14)
            buf4[0] = b_arg0_1
            buf4[1] = b_arg1_1
            buf4[2] = b_buf14
{after}"""


def test_a_finished_loop_releases_its_body_variables_and_its_list():
    """A Python for loop leaves its body's variables bound, and its list of carried values
    lived on: a loop nested in another loop's body kept the last iteration's buffers (here the
    stacked ``b_buf6``, through ``c_arg1_1`` and ``b_buf9``) alive into the next iteration."""
    code = NESTED.format(after="        buf8 = buf4[2]\n        return (buf8, )")
    lines = release_finished_loops(code).split("\n")
    assert len(lines) == len(code.split("\n"))
    # the inner loop: its body's variables after it, its list after the list's last use
    assert "            del c_arg0_1, c_arg1_1, c_buf6; del b_buf6" in lines
    assert "            del b_buf9; kernel(b_buf14)" in lines
    # the outer one: its body's variables after it (the inner loop's were deleted already)
    assert "        del b_arg0_1, b_arg1_1, b_arg2_1, u2, b_buf14; buf8 = buf4[2]" in lines
    assert "        del buf4; return (buf8, )" in lines


def test_a_list_inductor_deletes_itself_is_not_deleted_twice():
    lines = release_finished_loops(NESTED.format(after="        del buf4\n        return (buf8, )")).split("\n")
    assert sum("del buf4" in line for line in lines) == 1


def test_names_read_after_the_loop_in_a_deeper_block_stay():
    """``buf4`` and ``b_arg0_1`` are read in ``later``: neither is deleted (nor is anything else
    of the outer loop: a ``def`` line cannot take a ``del`` in front of it)."""
    code = NESTED.format(after="        def later():\n            return buf4, b_arg0_1")
    lines = release_finished_loops(code).split("\n")
    assert [line for line in lines if line.startswith("        del ")] == []
    assert "            del b_buf9; kernel(b_buf14)" in lines  # the inner loop's list still goes


GUARDED = """\
        buf2 = [buf1, buf0, arg0_1]
        for buf2_step in range(16):
            b_arg1_1 = buf2[1]
            b_arg2_1 = buf2[2]
            u0 = buf2_step
            with torch.cuda._DeviceGuard(0):
                torch.cuda.set_device(0)
                b_buf5 = empty_strided_cuda((4, 16), (16, 1), torch.float32)
                extern_kernels.mm(b_arg2_1, arg2_1, out=b_buf5)
                stream0 = get_raw_stream(0)
                kernel.run(b_arg2_1, b_buf5, b_arg1_1, u0, stream=stream0)
                del b_arg2_1
            if u0 > 3:
                b_buf9 = b_buf5
            buf2[1] = b_arg1_1
            buf2[2] = b_buf5
        buf5 = buf2[2]
        return (buf5, )"""


def test_a_cuda_body_deleting_under_its_device_guard_is_not_deleted_again():
    """On CUDA the body's kernels run in a ``with`` block (the device guard): a name deleted
    there is unbound after the loop (a second ``del`` raised UnboundLocalError there),
    while what that block assigns and keeps is released. What a conditional block assigns
    may be unbound: left alone."""
    lines = release_finished_loops(GUARDED).split("\n")
    assert "        del b_arg1_1, u0, b_buf5, stream0; buf5 = buf2[2]" in lines
