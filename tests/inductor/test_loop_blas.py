"""Float32 matmuls in the Python wrapper's counted loops call BLAS as ATen's mm would
(``inductor.codegen.blas``): the same bits as the loop's torch.mm, for the layouts ATen hands to
BLAS as they are. The C++ wrapper's twin: tests/inductor/test_cpp_wrapper.py."""
import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._pytree import tree_leaves
from conftest import reference_scan

from torch_scan_hop import scan
from torch_scan_hop.inductor.codegen import small_gemm
from torch_scan_hop.inductor.codegen.blas import blas_is_atens_float32_mm, mm_plan


@pytest.fixture(autouse=True)
def atens_gemm(monkeypatch):
    """The BLAS kernels call MKL's ``sgemm_`` here, whatever the CPU: ``small_gemm`` (on by default
    where MKL runs no AVX-512) has its own tests (test_small_gemm.py)."""
    monkeypatch.setenv(small_gemm.ENV, "0")


needs_blas = pytest.mark.skipif(
    not blas_is_atens_float32_mm(),
    reason="this torch's float32 CPU mm is not a plain MKL sgemm_ call (it is on x86 Linux wheels with fp32 "
           "precision 'ieee'), so the loops keep ATen's mm and there is no direct BLAS call to compare")


def _run(scan_fn, c0, xs, w1, w2):
    """Matmuls and an exact scale only: a row-major weight, a transposed one on either side."""
    return scan_fn(lambda c, x: (((c @ w1) @ w2.t()) * 0.5 + x, (c, x.t() @ c)), c0, xs)


def _compiled(length, batch, dtype=torch.float32):
    gen = torch.Generator().manual_seed(batch)
    rand = lambda *shape, scale=1.0: torch.randn(*shape, generator=gen, dtype=dtype) * scale
    args = rand(batch, 6), rand(length, batch, 6), rand(6, 3, scale=0.5), rand(6, 3, scale=0.5)
    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(lambda *a: _run(scan, *a), fullgraph=True), *args)
    return got, _run(reference_scan, *args), codes[0]


@needs_blas
@pytest.mark.parametrize("batch", [5, 1])
def test_float32_matmuls_in_the_loop_give_atens_bits(batch):
    got, want, code = _compiled(64, batch)
    for g, w in zip(tree_leaves(got), tree_leaves(want)):
        assert torch.equal(g, w), (g - w).abs().max()
    assert all(g.isfinite().all() for g in tree_leaves(got))
    loop = code[code.index("def call"):]  # the loop's body: Python lines, or comments of its C++ loop (loop_kernel)
    assert loop.count("scan_blas_sgemm(") == (3 if batch > 1 else 2)  # x.t() @ c of a batch of 1: a product
    assert "extern_kernels.mm(" not in loop


def _bits_against_atens_addmm(run, monkeypatch, code_index):
    """``run()`` compiled with our ``scan_blas_addmm`` and again with ATen's ``addmm`` (the kind taken
    out of ``blas.KINDS``): the results have the same bits; returns ours. ``code_index``: the graph
    (0 forward, 1 backward) whose code calls the addmm."""
    import torch_scan_hop.inductor.codegen.blas as blas

    with torch._inductor.config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(run)
        monkeypatch.delitem(blas.KINDS, "extern_kernels.addmm")
        atens, aten_codes = run_and_get_code(run)
    assert "scan_blas_addmm(" in codes[code_index] and "extern_kernels.addmm(" in aten_codes[code_index]
    for g, a in zip(got, atens):
        assert torch.equal(g, a), (g - a).abs().max()
    return got


@needs_blas
def test_weight_gradients_accumulate_with_atens_bits(monkeypatch):
    """The backward's ``addmm(grad_w, a, b, beta=1)`` (a weight gradient summed over steps) is
    ``self`` copied into the output, then ``sgemm_`` with beta 1, as ATen's ``addmm_impl_cpu_``:
    the bits of the same compiled loop calling ATen's addmm."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(6, 6, generator=gen) * 0.4).requires_grad_()
    c0, xs = torch.randn(5, 6, generator=gen, requires_grad=True), torch.randn(64, 5, 6, generator=gen)

    def run():
        torch._dynamo.reset()
        fn = torch.compile(lambda c0, xs: scan(lambda c, x: (torch.tanh(c @ w + x), c), c0, xs))
        c, ys = fn(c0, xs)
        return torch.autograd.grad(c.sum() + ys.pow(2).sum(), (w, c0))

    got = _bits_against_atens_addmm(run, monkeypatch, code_index=1)
    with torch.enable_grad():
        want = torch.autograd.grad((lambda c, ys: c.sum() + ys.pow(2).sum())(
            *reference_scan(lambda c, x: (torch.tanh(c @ w + x), c), c0, xs)), (w, c0))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@needs_blas
def test_a_linear_layers_bias_addmm_gives_atens_bits(monkeypatch):
    """``nn.Linear`` in the forward is ``addmm(bias, x, w.t())`` with a 1-D bias, which ATen expands
    to the output's shape and copies in before the gemm: our kernel copies it broadcast (stride 0
    rows), so a Linear body's loops call BLAS (they kept ATen's addmm, and the Python loop,
    before) with the bits of the same loop calling ATen's addmm."""
    torch.manual_seed(4)
    lin = torch.nn.Linear(6, 6)
    norm = torch.nn.LayerNorm(6)  # a reduction: the addmm is not unfused into a pointwise kernel
    c0, xs = torch.randn(5, 6, requires_grad=True), torch.randn(64, 5, 6)
    body = lambda c, x: (norm(lin(c + x)), c)

    def run():
        torch._dynamo.reset()
        c, ys = torch.compile(lambda c0, xs: scan(body, c0, xs))(c0, xs)
        return [c, ys, *torch.autograd.grad(c.sum() + ys.pow(2).sum(), (lin.weight, lin.bias, c0))]

    got = _bits_against_atens_addmm(run, monkeypatch, code_index=0)
    c, ys = reference_scan(body, c0, xs)
    want = [c, ys, *torch.autograd.grad(c.sum() + ys.pow(2).sum(), (lin.weight, lin.bias, c0))]
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_short_loops_keep_atens_mm():
    """Under 64 steps the BLAS kernel (one more C++ build on a cold cache) does not pay."""
    got, want, code = _compiled(4, 5)
    torch.testing.assert_close(got, want)
    assert "scan_blas_sgemm" not in code and "extern_kernels.mm(" in code


def test_other_dtypes_keep_atens_mm():
    got, want, code = _compiled(64, 5, dtype=torch.float64)
    torch.testing.assert_close(got, want)
    assert "scan_blas_sgemm" not in code and "extern_kernels.mm(" in code


@pytest.mark.parametrize("out,a,b,plan", [
    (((8, 64), (64, 1)), ((8, 64), (64, 1)), ((64, 64), (64, 1)), (True, False, False, 64, 8, 64, 64, 64, 64)),
    (((8, 64), (64, 1)), ((8, 64), (64, 1)), ((64, 64), (1, 64)), (True, True, False, 64, 8, 64, 64, 64, 64)),
    (((64, 8), (1, 64)), ((64, 8), (1, 64)), ((8, 8), (8, 1)), (False, False, True, 64, 8, 8, 64, 8, 64)),
    (((8, 64), (64, 1)), ((8, 64), (128, 2)), ((64, 64), (64, 1)), None),  # ATen copies a first
    (((0, 64), (64, 1)), ((0, 64), (64, 1)), ((64, 64), (64, 1)), None),   # empty: ATen returns early
])
def test_plan_is_atens_layout_decision(out, a, b, plan):
    assert mm_plan(out, a, b) == plan
