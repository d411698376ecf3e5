"""float32 ``tanh`` in our counted loops' C++ kernels: within 0.79 ulp of the exact value (checked
for every float), in ~45% of the time of the ATen vector ``tanh`` inductor writes otherwise.

Why: inductor's vector ``tanh`` is ATen's ``Vectorized<float>::tanh()``, Sleef's 1-ulp
``tanhf``, which computes ``expm1`` in double-float arithmetic: ~1.35 us per 512 floats on
AVX-512, more than the 8x64x64 matmul beside it in the tanh RNN's step (~0.56 us). XLA (JAX)
uses a rational approximation of a few ulp there; its scan's forward step was 0.5x ours. This
function keeps the loop's accuracy (Sleef's bound is 1.0 ulp; this one's measured worst is 0.79
ulp, over all 2^31 non-negative floats against float64 ``tanh``; odd by construction) and costs
~0.62 us per 512 floats:

- ``|x| < 0.7``: ``x + x^3 P(x^2)``, ``P`` of degree 5 (minimax, relative error 0.01 ulp);
- ``|x| >= 0.7``: ``1 - 2E/(1+E)`` with ``E = exp(-2|x|)`` (Cody-Waite reduction, degree-7
  polynomial, ``2^n`` from its bits; ``|x|`` capped at 10 where ``tanh`` rounds to 1); the
  quotient's rounding and ``1 + E``'s and ``1 - q``'s are carried as exact error terms (one
  division, FMAs), so that only ``E``'s error (damped: ``E < 0.25``) and the last rounding remain;
- the sign copied from ``x``; NaN gives NaN, ``+-inf`` gives ``+-1``, ``-0`` gives ``-0``.

The arithmetic is IEEE single precision elementwise (adds, multiplies, FMAs, one division,
round-to-nearest-int): the same bits on AVX2 and AVX-512, and with inductor's flags
(``-fno-unsafe-math-optimizations``: the compiler keeps the error terms). Used only where those
hold: an AVX2 / AVX-512 kernel, a ``Vectorized<float>`` operand, in the body of one of our
counted loops, and inductor's own ``cpp.use_decompose_tanh`` off (a user who asked for that
decomposition gets it). Counted as ``fast_tanh`` applied / skipped in ``pipeline.pass_counts``;
``passes_off("fast_tanh")`` gives ATen's ``tanh`` back.
"""
import torch

from ... import _compat
from . import counted_loops, pipeline

NAME = "fast_tanh"
ISAS = ("avx2", "avx512")  # the vector ISAs whose at::vec arithmetic the module docstring relies on

# One C++ expression (a lambda applied to the operand): CSE writes it as one ``auto tmp = ...;``.
_BODY = """
using VF = at::vec::Vectorized<float>; using VI = at::vec::Vectorized<int32_t>;
const VF a = x.abs(); const VF u = a * a;
VF p = at::vec::fmadd(VF(1.895661117e-03f), u, VF(-7.883302867e-03f));
p = at::vec::fmadd(p, u, VF(2.157105692e-02f)); p = at::vec::fmadd(p, u, VF(-5.392095447e-02f));
p = at::vec::fmadd(p, u, VF(1.333298385e-01f)); p = at::vec::fmadd(p, u, VF(-3.333332539e-01f));
const VF small = at::vec::fmadd(a * u, p, a);
const VF z = at::vec::clamp_min(a * VF(-2.f), VF(-20.f));
const VF n = (z * VF(1.442695041f)).round();
VF r = at::vec::fnmadd(n, VF(0.693145752f), z);
r = at::vec::fnmadd(n, VF(1.428606820e-06f), r);
VF q = at::vec::fmadd(VF(1.979033550e-04f), r, VF(1.394464751e-03f));
q = at::vec::fmadd(q, r, VF(8.333496749e-03f)); q = at::vec::fmadd(q, r, VF(4.166629538e-02f));
q = at::vec::fmadd(q, r, VF(1.666666567e-01f)); q = at::vec::fmadd(q, r, VF(5.000000000e-01f));
const VF e = at::vec::fmadd(r * r, q, r) + VF(1.f);
const VI bits = (at::vec::convert_to_int_of_same_size(n) + VI(127)) << VI(23);
const VF E = e * at::vec::cast<float>(bits);
const VF d = VF(1.f) + E; const VF d_lo = E - (d - VF(1.f));
const VF inv = VF(1.f) / d; const VF num = E + E; const VF q0 = num * inv;
const VF res = at::vec::fnmadd(q0, d, num) - q0 * d_lo;
const VF s = VF(1.f) - q0; const VF s_lo = (VF(1.f) - s) - q0;
const VF large = s + at::vec::fnmadd(res, inv, s_lo);
return VF::blendv(large, small, a < VF(0.7f)) | (x & VF(-0.f));
"""
FUNCTION = "([](const at::vec::Vectorized<float>& x) { " + " ".join(_BODY.split()) + " })"


def vector_tanh(operand, dtype, aten_tanh):
    """The C++ expression of ``tanh(operand)`` for a vector kernel being generated: ours where the
    module docstring says it is used (counted applied), else ``aten_tanh(operand)`` (counted
    skipped when in one of our loops; kernels elsewhere are not ours to count)."""
    if not counted_loops.counted_loop_trip_counts():
        return aten_tanh(operand)
    usable = (not pipeline.is_off(NAME) and dtype == torch.float32
              and not _compat.inductor.config().cpp.use_decompose_tanh
              and _compat.inductor.vector_kernel_type(dtype) == "at::vec::Vectorized<float>"
              and _compat.inductor.vector_isa_name() in ISAS)
    pipeline.record(NAME, "applied" if usable else "skipped")
    return f"{FUNCTION}({operand})" if usable else aten_tanh(operand)


def install():
    """Route inductor's vector ``tanh`` through ``vector_tanh``. Idempotent."""
    _compat.inductor.wrap_vector_tanh(vector_tanh)
