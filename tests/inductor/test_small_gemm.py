"""The float32 products of our loops' BLAS kernels by ``inductor.codegen.small_gemm``'s AVX-512
gemm (used where MKL's ``sgemm_`` does not run AVX-512: non-Intel x86): BLAS's ``sgemm_``
semantics for every layout it is handed (transposes, leading dimensions past the sizes, tails of
the register blocks, K past a chunk, K = 0, beta 0 never reading C), as close to the exact product
as MKL's; the shapes it leaves to ``sgemm_`` get MKL's bits; a compiled scan's values and
gradients with it on; ``SCAN_SMALL_GEMM`` and ``passes_off`` turn it off."""
import contextlib

import pytest
import torch
from conftest import assert_trees_close, reference_scan
from cpp_wrapper_cases import matmul_body_problem
from torch._inductor.codecache import CppPythonBindingsCodeCache
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan
from torch_scan_hop.inductor import codegen
from torch_scan_hop.inductor.codegen import blas, small_gemm

pytestmark = [
    pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                       reason="small_gemm is an AVX-512 kernel; this CPU's ATen capability is "
                              f"{torch.backends.cpu.get_cpu_capability()!r}"),
    pytest.mark.skipif(not blas.blas_is_atens_float32_mm(),
                       reason="this torch's float32 CPU mm is not a plain MKL sgemm_ call: no BLAS kernels"),
]


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(small_gemm.ENV, "1")


def _kernels(threads=1, ours=True):
    """(sgemm kernel, addmm kernel) built from ``blas``'s sources, with our gemm in them or not."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(small_gemm.ENV, "1" if ours else "0")
            sources = blas.kernel_source(blas.SGEMM_KERNEL, False), blas.kernel_source(blas.ADDMM_KERNEL, True)
    finally:
        torch.set_num_threads(prev)
    assert all(("scan_small_gemm::sgemm(" in s) == ours for s in sources)
    return (CppPythonBindingsCodeCache.load_pybinding(blas.SGEMM_ARGTYPES, sources[0]),
            CppPythonBindingsCodeCache.load_pybinding(blas.ADDMM_ARGTYPES, sources[1]))


def _operand(rows, cols, transposed, pad, gen):
    """A column-major ``rows x cols`` BLAS operand as a tensor ``op`` (the matrix) and its storage
    view: stored transposed or not, with ``pad`` extra rows of leading dimension."""
    if transposed:  # stored as cols x rows (column-major), ld = cols + pad
        storage = torch.randn(rows, cols + pad, generator=gen)
        return storage[:, :cols], storage, cols + pad
    storage = torch.randn(cols, rows + pad, generator=gen)
    return storage[:, :rows].t(), storage, rows + pad


CASES = [  # (ta, tb, m, n, k, beta)
    (0, 0, 256, 64, 256, 0), (1, 0, 256, 64, 256, 0), (0, 1, 256, 256, 64, 1), (1, 1, 45, 40, 520, 1),
    (0, 0, 64, 8, 64, 0), (0, 1, 64, 64, 8, 1), (0, 0, 37, 13, 300, 0), (1, 0, 33, 35, 257, 1),
    (0, 0, 1, 1, 1, 0), (0, 1, 17, 9, 1, 1), (0, 0, 15, 7, 513, 0), (1, 1, 70, 33, 16, 0),
    (0, 0, 31, 3, 0, 0), (0, 1, 16, 5, 0, 1), (1, 0, 200, 32, 100, 1),
    (1, 0, 64, 8, 64, 0), (1, 0, 20, 2, 40, 1), (1, 1, 17, 3, 33, 0), (1, 0, 48, 5, 19, 0), (1, 1, 32, 2, 16, 1),
]


@pytest.mark.parametrize("ta, tb, m, n, k, beta", CASES)
def test_products_as_close_to_exact_as_mkls(forced, ta, tb, m, n, k, beta):
    sgemm, addmm = _kernels()
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    a, a_store, lda = _operand(m, k, ta, 3, gen)
    b, b_store, ldb = _operand(k, n, tb, 2, gen)
    c_store = torch.full((n, m + 4), float("nan")) if not beta else torch.randn(n, m + 4, generator=gen)
    c = c_store[:, :m].t()  # column-major m x n, ldc = m + 4
    exact = a.double() @ b.double() + (c.double() if beta else 0)
    mkl = torch.addmm(c, a, b) if beta else a @ b
    ints = (ta, tb, m, n, k, lda, ldb, m + 4)
    if beta:
        addmm(c_store, c_store, a_store, b_store, *ints, 0, 0, 0, 0, 0, 0)
    else:
        sgemm(c_store, a_store, b_store, *ints)
    err, mkl_err = (c.double() - exact).abs(), (mkl.double() - exact).abs()
    scale = (a.double().abs() @ b.double().abs() + (c.double().abs() if beta else 0)).clamp_min(1e-30)
    assert torch.isfinite(c).all()  # beta 0: C's NaNs never read
    assert (err <= max(k, 1) * 2 ** -24 * scale + 1e-30).all()  # the classic bound of a float32 dot product
    if k >= 64:
        assert err.pow(2).mean().sqrt() <= 2 * mkl_err.pow(2).mean().sqrt() + 1e-7


def test_shapes_it_leaves_get_mkls_bits():
    """op(A) transposed times one column (MKL's matrix-vector product is faster) and, in a
    process of four threads, a product past ``_SERIAL_MAX``: ``sgemm_``'s call, its bits."""
    mkl, ours, ours_four_threads = _kernels(ours=False)[0], _kernels()[0], _kernels(threads=4)[0]
    gen = torch.Generator().manual_seed(0)
    for kernel, (ta, m, n, k) in ((ours, (1, 64, 1, 1000)), (ours_four_threads, (0, 128, 128, 1000))):
        _, a_store, lda = _operand(m, k, ta, 0, gen)
        _, b_store, ldb = _operand(k, n, False, 0, gen)
        got, want = torch.empty(n, m), torch.empty(n, m)
        for fn, c in ((kernel, got), (mkl, want)):
            fn(c, a_store, b_store, ta, 0, m, n, k, lda, ldb, m)
        assert torch.equal(got, want)
    assert 128 * 128 * 1000 > small_gemm._SERIAL_MAX


def _mlp(scan_fn, params, c0, xs):
    def step(c, x):
        h = c + x
        for w, b in zip(params[::2], params[1::2]):
            h = torch.tanh(h @ w + b)
        return h, h.mean(-1)

    c, ys = scan_fn(step, c0, xs)
    return c.sum() + ys.sum()


def _compiled_mlp_grads():
    gen = torch.Generator().manual_seed(0)
    params = [t.requires_grad_() for _ in range(2) for t in (torch.randn(48, 48, generator=gen) / 7, torch.randn(48, generator=gen))]
    c0, xs = torch.randn(40, 48, generator=gen, requires_grad=True), torch.randn(64, 40, 48, generator=gen, requires_grad=True)
    inputs = [*params, c0, xs]
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(lambda *a: _mlp(scan, list(a[:-2]), a[-2], a[-1]), fullgraph=True)
        (loss, grads), codes = run_and_get_code(lambda: (lambda v: (v, torch.autograd.grad(v, inputs)))(compiled(*inputs)))
    want = _mlp(reference_scan, params, c0, xs)
    return (loss, grads), (want, torch.autograd.grad(want, inputs)), codes


def test_compiled_scan_values_and_gradients(forced):
    codegen.reset_pass_counts()
    got, want, codes = _compiled_mlp_grads()
    assert_trees_close(got, want, rtol=2e-5, atol=2e-5)
    assert codegen.pass_counts()[small_gemm.NAME]["applied"] >= 6  # 2 forward, 4+ backward products
    assert any("scan_small_gemm::sgemm(" in code for code in codes)


@pytest.mark.parametrize("how", ["env", "passes_off"])
def test_turned_off_gives_atens_call(monkeypatch, how):
    monkeypatch.setenv(small_gemm.ENV, "0" if how == "env" else "1")
    codegen.reset_pass_counts()
    with codegen.passes_off(small_gemm.NAME) if how == "passes_off" else contextlib.nullcontext():
        assert not small_gemm.enabled()
        got, want, codes = _compiled_mlp_grads()
    assert_trees_close(got, want, rtol=2e-5, atol=2e-5)
    assert not any("scan_small_gemm" in code for code in codes)
    assert codegen.pass_counts()[small_gemm.NAME]["skipped"] >= 6


def test_default_follows_mkls_vendor_check(monkeypatch):
    monkeypatch.delenv(small_gemm.ENV, raising=False)
    assert small_gemm.enabled() == (not small_gemm._mkl_takes_intel_path())


@pytest.mark.parametrize("batch, hidden, inputs", [(5, 40, 17), (33, 7, 48), (1, 32, 3), (16, 70, 33)])
def test_random_matmul_bodies_against_the_loop_in_float64(forced, batch, hidden, inputs):
    """A body with each kind of product the loops hand BLAS (a weight on either side, transposed or
    not, a Linear's bias, a carry's transpose times the input) at sizes off the register blocks,
    64 steps, trained: the compiled scan's values and gradients against the loop in float64."""
    run, inputs_ = matmul_body_problem(batch, hidden, inputs)
    torch._dynamo.reset()
    codegen.reset_pass_counts()
    with torch._inductor.config.patch(force_disable_caches=True):
        loss, outs = torch.compile(lambda *a: run(scan, *a), fullgraph=True)(*inputs_)
        got = outs, torch.autograd.grad(loss, inputs_)
    doubles = [t.detach().double().requires_grad_() for t in inputs_]
    loss64, outs64 = run(reference_scan, *doubles)
    want = tuple(t.float() for t in outs64), tuple(g.float() for g in torch.autograd.grad(loss64, doubles))
    assert_trees_close(got, want, rtol=1e-4, atol=1e-4)
    assert codegen.pass_counts()[small_gemm.NAME]["applied"] >= 4


@pytest.mark.parametrize("on, how, batch, hidden, inputs", [(True, "option", 16, 70, 33), (False, "global", 5, 40, 17)])
def test_cpp_wrapper_scan_values_gradients_and_counts(on, how, batch, hidden, inputs):
    """The C++ wrapper's twin (``cpp_text.call_blas_for_mm``): ``cpp_wrapper_cases.check_small_gemm`` in a
    child interpreter whose ``SCAN_SMALL_GEMM`` is 1 / 0 (a crash in generated code fails this test only)."""
    import _isolated

    _isolated.call("cpp_wrapper_cases", "check_small_gemm", how, on, batch, hidden, inputs,
                   env={small_gemm.ENV: "1" if on else "0"})
