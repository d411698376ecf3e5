"""A carried sum an ``addmm`` accumulates in a counted loop of the Python wrapper (a weight gradient)
is written into the carry's own buffer (``inductor.codegen.carry_in_place``): the rewrite of the
generated text, the loops it must leave alone, and compiled gradients against the Python loop."""
import pytest
import torch
from conftest import reference_scan
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan
from torch_scan_hop.inductor import codegen
from torch_scan_hop.inductor.codegen import blas
from torch_scan_hop.inductor.codegen.carry_in_place import accumulate_carries_in_place, unreadable_addmm

W = "empty_strided_cpu((64, 64), (64, 1), torch.float32)"
LOOP = """\
        buf0 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
        buf2 = {init_alloc}
        cpp_fused_zeros_0(buf0, buf2)
        buf5 = [buf0, {init}]
        for buf5_step in range(16):
            # subgraph: body
            b_arg0_1 = buf5[0]
            b_arg1_1 = buf5[1]
            u3 = buf5_step
            b_buf5 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
            kernel(b_arg0_1, out=b_buf5)
            b_buf7 = {out_alloc}
            # Unsorted Source Nodes: [], Original ATen: [aten.addmm]
            extern_kernels.addmm(b_arg1_1, reinterpret_tensor(b_buf5, (64, 8), (1, 64), 0), b_arg0_1, alpha=1, beta=1, out=b_buf7)
            del b_arg1_1
{extra}            buf5[0] = b_buf5
            buf5[1] = {second}
        buf9 = buf5[1]
{after}        return (buf9, )"""


def _loop(init="buf2", init_alloc=W, out_alloc=W, extra="", second="b_buf7", after=""):
    return LOOP.format(init=init, init_alloc=init_alloc, out_alloc=out_alloc, extra=extra, second=second,
                       after=after)


def test_the_sum_is_written_into_the_carry():
    code = _loop()
    new = accumulate_carries_in_place(code)
    assert len(new.split("\n")) == len(code.split("\n"))  # inductor's line map stays right
    assert "            b_buf7 = b_arg1_1  # accumulated in place" in new.split("\n")
    assert new.replace("b_buf7 = b_arg1_1  # accumulated in place", f"b_buf7 = {W}") == code


@pytest.mark.parametrize("init, after, why", [
    ("primals_3", "", "a graph input"),
    ("buf2", "        foo(buf2)\n", "read after the loop"),
    ("buf2, buf2", "", "two carries of one buffer"),
])
def test_an_initial_value_the_loop_does_not_own_is_copied_once(init, after, why):
    code = _loop(init=init, after=after)
    if init == "buf2, buf2":  # a third carry, handed on as it is
        code = code.replace("            buf5[1] = b_buf7", "            buf5[1] = b_buf7\n            buf5[2] = buf5[2]")
    lines = accumulate_carries_in_place(code).split("\n")
    assert "            b_buf7 = b_arg1_1  # accumulated in place" in lines, why
    assert f"        buf5 = [buf0, {init}]; buf5[1] = {W}.copy_(buf5[1])" in lines, why


def test_an_initial_value_of_another_layout_is_copied_into_the_sums():
    lines = accumulate_carries_in_place(_loop(init_alloc="empty_strided_cpu((64, 64), (1, 64), torch.float32)"))
    assert f"        buf5 = [buf0, buf2]; buf5[1] = {W}.copy_(buf5[1])" in lines.split("\n")


@pytest.mark.parametrize("extra, second, why", [
    ("            kernel(b_arg1_1)\n", "b_buf7", "the old sum read after the new one is written"),
    ("", "b_arg1_1", "the old sum handed on"),
    ("            buf5[0] = b_buf7\n", "b_buf7", "the new sum handed on twice"),
    ("            if u3 > 3:\n                kernel(b_buf5)\n", "b_buf7", "a conditional block"),
    ("            b_old = buf5[1]\n            kernel(b_old)\n", "b_buf7", "the old sum bound twice"),
    ("", "b_buf7", "the sum written in a nested loop"),
])
def test_loops_left_alone(extra, second, why):
    code = _loop(extra=extra, second=second)
    if why == "the sum written in a nested loop":
        lines = code.split("\n")
        at = next(k for k, line in enumerate(lines) if line.startswith("            b_buf7 = "))
        lines[at:at + 4] = ["            for c_step in range(2):", *("    " + line for line in lines[at:at + 4])]
        code = "\n".join(lines)
    assert accumulate_carries_in_place(code) == code, why


def test_a_pooled_output_drops_its_pool():
    pool = f"buf5_pool0 = ({W}, {W},)"
    code = _loop(out_alloc="buf5_pool0[buf5_step & 1]").replace(
        "        buf5 = [buf0, buf2]", f"        buf5 = [buf0, buf2]; {pool}")
    lines = accumulate_carries_in_place(code).split("\n")
    assert "        buf5 = [buf0, buf2]" in lines
    assert "            b_buf7 = b_arg1_1  # accumulated in place" in lines


GUARDED = """\
    with torch.cuda._DeviceGuard(0):
        buf2 = empty_strided_cuda((64, 64), (64, 1), torch.float32)
        triton_poi_fused_zeros_0.run(buf2, 4096, stream=stream0)
        buf5 = [buf0, buf2]
        for buf5_step in range(16):
            b_arg0_1 = buf5[0]
            b_arg1_1 = buf5[1]
            with torch.cuda._DeviceGuard(0):
                torch.cuda.set_device(0)
                b_buf7 = empty_strided_cuda((64, 64), (64, 1), torch.float32)
                extern_kernels.addmm(b_arg1_1, reinterpret_tensor(b_arg0_1, (64, 8), (1, 64), 0), b_arg0_1, alpha=1, beta=1, out=b_buf7)
                del b_arg1_1
            buf5[0] = b_arg0_1
            buf5[1] = b_buf7
        buf9 = buf5[1]
        del buf2
        return (buf9, )"""


def test_under_a_device_guard():
    """On CUDA the body's kernels run in a ``with`` block (and so does the outer graph's code)."""
    lines = accumulate_carries_in_place(GUARDED).split("\n")
    assert "                b_buf7 = b_arg1_1  # accumulated in place" in lines
    assert "        buf5 = [buf0, buf2]" in lines


def test_blas_kernel_form():
    call = ("            scan_blas_addmm(b_buf7, b_arg1_1, b_arg0_1, b_buf5, 0, 1, 64, 64, 8, 64, 64, 64, "
            "64, 64, {c}, 1, {s})")
    for c, s, rewritten in (("64", "64, 1", True), ("64", "1, 64", False)):
        code = _loop().replace(
            "            extern_kernels.addmm(b_arg1_1, reinterpret_tensor(b_buf5, (64, 8), (1, 64), 0), b_arg0_1, "
            "alpha=1, beta=1, out=b_buf7)", call.format(c=c, s=s))
        assert ("b_buf7 = b_arg1_1  # accumulated in place" in accumulate_carries_in_place(code)) == rewritten


def test_an_addmm_of_another_form_is_a_broken_precondition():
    code = _loop().replace(", out=b_buf7)", ")")
    assert unreadable_addmm(code) is not None and unreadable_addmm(_loop()) is None


def _mlp(ws):
    def body(c, x):
        h = c + x
        for w in ws:
            h = torch.tanh(h @ w)
        return h, h.sum(-1)
    return body


@pytest.mark.parametrize("remat", ["save_all", "recompute_all", "sqrt"])
def test_compiled_gradients_match_the_loop(remat):
    """float64 gradients of a 2-layer MLP body; ``sqrt``'s backward shares its zeros between two
    loops (the first copies them once)."""
    def grads(run):
        gen = torch.Generator().manual_seed(0)
        ws = [(torch.randn(16, 16, dtype=torch.float64, generator=gen) * 0.3).requires_grad_() for _ in range(2)]
        c = torch.randn(4, 16, dtype=torch.float64, generator=gen).requires_grad_()
        xs = torch.randn(9, 4, 16, dtype=torch.float64, generator=gen).requires_grad_()
        carry, ys = run(_mlp(ws), c, xs)
        (carry.square().sum() + ys.sum()).backward()
        return [t.grad for t in (*ws, c, xs)]

    torch._dynamo.reset()
    codegen.reset_pass_counts()
    got, codes = run_and_get_code(grads, torch.compile(lambda body, c, xs: scan(body, c, xs, remat=remat)))
    want = grads(reference_scan)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)
    assert codegen.pass_counts()["accumulate_carries_in_place"]["applied"] >= 1
    assert "# accumulated in place" in "\n".join(codes)


@pytest.mark.parametrize("length", [9, 64])  # 64: the matmuls are blas's kernels where ATen's mm is sgemm
def test_float32_gradients_are_the_bits_without_the_pass(length):
    """The same kernels on the same operands in the same order: in place changes no bit. (The loop
    kept in Python: run as one C++ kernel it accumulates in place itself, ``accumulate``.)"""
    def grads(run):
        gen = torch.Generator().manual_seed(0)
        ws = [(torch.randn(32, 32, generator=gen) * 0.2).requires_grad_() for _ in range(2)]
        c, xs = torch.randn(4, 32, generator=gen), torch.randn(length, 4, 32, generator=gen)
        carry, ys = run(_mlp(ws), c, xs)
        (carry.square().sum() + ys.sum()).backward()
        return [w.grad for w in ws]

    def compiled(off):
        torch._dynamo.reset()
        codegen.reset_pass_counts()
        with torch._inductor.config.patch(force_disable_caches=True), \
                codegen.passes_off("run_loops_as_one_kernel", *(["accumulate_carries_in_place"] if off else [])):
            got = grads(torch.compile(lambda body, c, xs: scan(body, c, xs, remat="recompute_all")))
        counts = codegen.pass_counts()
        return got, (counts["accumulate_carries_in_place"]["applied"], counts["blas_extern_calls"]["applied"])

    (want, _), (got, (applied, blas_calls)) = compiled(off=True), compiled(off=False)
    assert applied >= 1
    assert (blas_calls > 0) == (length == 64 and blas.blas_is_atens_float32_mm())
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()
    for g, r in zip(got, grads(reference_scan)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
