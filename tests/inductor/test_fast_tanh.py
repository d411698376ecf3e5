"""float32 ``tanh`` in our loops' C++ kernels is ``inductor.codegen.fast_tanh``'s: within 1 ulp of
the exact value everywhere (measured worst 0.79 ulp; Sleef's, which eager uses, is documented
1.0), signs, zeros, infinities and NaN as ``torch.tanh``; the same on AVX2 and AVX-512 kernels;
only in our loops; ``passes_off("fast_tanh")`` gives ATen's back."""
import numpy as np
import pytest
import torch
from conftest import assert_trees_close, reference_scan
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import _compat, scan
from torch_scan_hop.inductor import codegen
from torch_scan_hop.inductor.codegen import fast_tanh

ISA = _compat.inductor.vector_isa_name()
needs_avx = pytest.mark.skipif(ISA not in fast_tanh.ISAS,
                               reason=f"fast_tanh is written for AVX2/AVX-512 kernels; this CPU's inductor ISA is {ISA!r}")


def _probe_values():
    """float32 points where an error would show: every float around the switch between the two
    formulas (0.7) and around the measured worst case (0.8505), log-spaced points from subnormals
    to 30 of both signs, and the special values."""
    def every_float(lo, hi):
        return np.arange(np.float32(lo).view(np.int32), np.float32(hi).view(np.int32), dtype=np.int32).view(np.float32)

    logs = np.logspace(-44, np.log10(30.0), 200_000).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 10.0, 9.0, 1e-30], np.float32)
    vals = np.concatenate([every_float(0.69, 0.71), every_float(0.8495, 0.8515), logs, -logs[::3], special])
    vals = vals[: len(vals) - len(vals) % 4]
    return torch.from_numpy(vals.copy()).reshape(4, -1)


def _tanh_rows(xs):
    return scan(lambda c, x: (c + 1, torch.tanh(x)), torch.zeros(()), xs)[1]


def _ulp_errors(got, x):
    """|got - tanh(x)| in units of the float32 spacing at the exact value (float64 reference)."""
    exact = torch.tanh(x.double())
    at = exact.float().abs()
    spacing = (torch.nextafter(at, torch.tensor(float("inf"))) - at).double()
    spacing = torch.where(at == 1, torch.tensor(2.0 ** -24, dtype=torch.float64), spacing)
    finite = torch.isfinite(exact)
    return ((got.double() - exact).abs() / spacing)[finite]


@needs_avx
@pytest.mark.parametrize("simdlen", [None, 256], ids=["native", "avx2"])
def test_within_one_ulp_and_special_values_as_torch(simdlen):
    xs = _probe_values()
    codegen.reset_pass_counts()
    with torch.no_grad(), torch._inductor.config.patch({"force_disable_caches": True, "cpp.simdlen": simdlen}):
        torch._dynamo.reset()
        got = torch.compile(_tanh_rows)(xs)
    assert codegen.pass_counts()["fast_tanh"]["applied"] >= 1
    errors = _ulp_errors(got, xs)
    assert errors.max() < 1.0, (errors.max(), xs.reshape(-1)[torch.isfinite(torch.tanh(xs.reshape(-1)))][errors.argmax()])
    want = torch.tanh(xs)
    exact_cases = ~torch.isfinite(xs) | (xs == 0) | (xs.abs() >= 9) | (xs.abs() < 1e-30)
    assert torch.equal(got[exact_cases].isnan(), want[exact_cases].isnan())
    same = exact_cases & ~want.isnan()
    assert torch.equal(got[same], want[same]) and torch.equal(got[same].signbit(), want[same].signbit())


@needs_avx
def test_values_and_gradients_of_a_tanh_rnn_as_the_loop():
    """A training step through the fast forward: values and gradients of W, init and xs as the
    Python loop's (float32 tolerances), as with ATen's tanh (``passes_off``)."""
    torch.manual_seed(0)
    w = (torch.randn(16, 16) * 0.3).requires_grad_()
    c0, xs = torch.randn(4, 16, requires_grad=True), torch.randn(40, 4, 16, requires_grad=True)

    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    def loss(c0, xs):
        c, ys = scan(step, c0, xs)
        return c.sum() + (ys * ys).sum()

    c, ys = reference_scan(step, c0, xs)
    want = torch.autograd.grad(c.sum() + (ys * ys).sum(), (w, c0, xs))
    results = {}
    for off in ((), ("fast_tanh",)):
        codegen.reset_pass_counts()
        with codegen.passes_off(*off), torch._inductor.config.patch(force_disable_caches=True):
            torch._dynamo.reset()
            value = torch.compile(loss)(c0, xs)
            results[off] = (value, torch.autograd.grad(value, (w, c0, xs)))
        counts = codegen.pass_counts().get("fast_tanh", {})
        assert counts.get("applied" if not off else "skipped", 0) >= 1, counts
    for value, grads in results.values():
        assert_trees_close(grads, want, rtol=2e-4, atol=2e-5)
    assert_trees_close(results[()], results[("fast_tanh",)], rtol=2e-4, atol=2e-5)


def test_only_in_our_loops_and_not_float64():
    """A tanh compiled outside a scan is inductor's own (ATen's ``.tanh()``, nothing counted); a
    float64 scan keeps ATen's tanh (counted skipped) and the loop's values."""
    x = torch.randn(64, 32)
    codegen.reset_pass_counts()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        torch._dynamo.reset()
        _, (code,) = run_and_get_code(torch.compile(torch.tanh), x)
        assert ".tanh()" in code and fast_tanh.FUNCTION not in code
        assert "fast_tanh" not in codegen.pass_counts()
        xs = torch.randn(6, 4, 32, dtype=torch.float64)
        got = torch.compile(_tanh_rows)(xs)
    counts = codegen.pass_counts()["fast_tanh"]
    assert counts["applied"] == 0 and counts["skipped"] >= 1, counts
    torch.testing.assert_close(got, torch.tanh(xs), rtol=1e-14, atol=0)
