"""Float32 matmuls in our loops' BLAS kernels (``blas``; in the C++ wrapper its ``scan_blas_mm_out``
helper, ``blas.mm_out_helper``) as a register-blocked AVX-512 gemm of our own, on the CPUs where MKL's
``sgemm_`` does not use AVX-512: x86 CPUs that are not Intel's.

Why: MKL picks its code path by the CPU's vendor, not by its instruction sets. On an AMD EPYC with
AVX-512 (Zen 4 / Zen 5), torch's MKL runs its AVX2 path: one thread, the MLP body's step matmul
(64x256 @ 256x256) took 78-80 us in ``sgemm_`` against 33 us for MKL's own AVX-512 path (the same
library told the CPU is Intel's) and ~30 us for this kernel; ``jax.jit(lax.scan)`` (XLA's dot)
ran the whole MLP forward in 0.47x our time there. The kernel: 32 rows by up to 8 columns of C in
16 ``zmm`` accumulators, an FMA per element pair, K in chunks of 256 (the A panel stays in L1);
``op(A)`` transposed is first copied into a 32-row panel. It runs where it pays: with up to two
intra-op threads (one thread of it beat MKL's two there, 64x256x256 to 512x512x512: 32 vs 46 us,
1.08 vs 1.28 ms), with more only for products of at most ``_SERIAL_MAX`` multiply-adds (which MKL
would hardly split across threads), and not for ``op(A)`` transposed times one column (MKL's
matrix-vector product is faster there than the panel's copy). 64x256 @ 256x64 with op(A)
transposed (a backward's input gradient): 78 us in ``sgemm_``, 36 us here (the copy by 16x16
transposes in registers).

Numbers: float32 FMAs summed in order over K in chunks of 256, each chunk's sum then added to C
(as BLAS adds beta C): a rounding of the same sum as MKL's, not always its bits (MKL blocks K its
own way; on short K they often agree). So where this kernel is used the loop's
matmuls are no longer ATen's to the bit (``blas``'s promise elsewhere); they are as close to the
exact product as MKL's (tests/inductor/test_small_gemm.py compares both with float64).

When (``enabled``): ATen's float32 mm is a plain ``sgemm_`` call (``blas``), ATen's CPU capability is
``AVX512``, MKL says the CPU is not Intel's (``mkl_serv_intel_cpu_true``, exported by libtorch_cpu;
absent: not used), and ``passes_off("small_gemm")`` is not in force. ``SCAN_SMALL_GEMM=1`` uses it
on any AVX-512 CPU (tests), ``=0`` never. Counted as ``small_gemm`` applied / skipped per matmul
planned as a BLAS call (``pipeline.pass_counts``; in the C++ wrapper per ``mm`` call its text pass
rewrites): applied where its kernel (helper) carries this gemm (the shapes it leaves still go to
``sgemm_`` when they run). The C++ wrapper gets ``SOURCE`` in its header at codegen
(``blas.cpp_prelude``): the helper is one line of the wrapper and cannot include ``<immintrin.h>``.
"""
import functools
import os

from . import pipeline

NAME = "small_gemm"
ENV = "SCAN_SMALL_GEMM"
_SERIAL_MAX = 1 << 20  # multiply-adds of a product past which MKL's threads win (more than 2 of them)
_THREADS_ANY_SIZE = 2  # up to this many intra-op threads, this kernel's one thread wins at any size

NAMESPACE = "namespace scan_small_gemm {"  # SOURCE's line that says it is defined (``cpp_text``)
SOURCE = r'''
#include <immintrin.h>
namespace scan_small_gemm {
constexpr int64_t MR = 32, NR = 8, KC = 256, SERIAL_MAX = %(serial_max)d;
// C[:rows, :NB] = a[:rows, :kc] b[:kc, :NB] (+ C): a's column p at a + p * a_p, b's (p, j) at b[p * b_p + j * b_j]
template <int NB>
__attribute__((target("avx512f"))) static inline void block(
    const float* a, int64_t a_p, __mmask16 m0, __mmask16 m1, const float* b, int64_t b_p, int64_t b_j,
    int64_t kc, float* c, int64_t ldc, bool load_c) {
  __m512 c0[NB], c1[NB];
  for (int j = 0; j < NB; ++j) c0[j] = c1[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; ++p) {
    const __m512 a0 = _mm512_maskz_loadu_ps(m0, a + p * a_p), a1 = _mm512_maskz_loadu_ps(m1, a + p * a_p + 16);
    const float* bp = b + p * b_p;
    for (int j = 0; j < NB; ++j) {
      const __m512 bj = _mm512_set1_ps(bp[j * b_j]);
      c0[j] = _mm512_fmadd_ps(a0, bj, c0[j]);
      c1[j] = _mm512_fmadd_ps(a1, bj, c1[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    if (load_c) {  // the product, then C added (as BLAS: alpha op(A) op(B) + beta C)
      c0[j] = _mm512_add_ps(c0[j], _mm512_maskz_loadu_ps(m0, c + j * ldc));
      c1[j] = _mm512_add_ps(c1[j], _mm512_maskz_loadu_ps(m1, c + j * ldc + 16));
    }
    _mm512_mask_storeu_ps(c + j * ldc, m0, c0[j]);
    _mm512_mask_storeu_ps(c + j * ldc + 16, m1, c1[j]);
  }
}
// dst[q * MR + r] = src[q + r * lda] for q, r < 16: a 16x16 transpose in registers
__attribute__((target("avx512f"))) static inline void transpose16(const float* src, int64_t lda, float* dst) {
  __m512 v[16], s[16];
  for (int r = 0; r < 16; ++r) v[r] = _mm512_loadu_ps(src + r * lda);
  for (int r = 0; r < 16; r += 2) {  // per 128-bit lane: rows r, r+1 interleaved, columns 0-1 / 2-3
    s[r] = _mm512_unpacklo_ps(v[r], v[r + 1]);
    s[r + 1] = _mm512_unpackhi_ps(v[r], v[r + 1]);
  }
  for (int r = 0; r < 16; r += 4) {  // v[r + c]: lane l holds column 4l + c of rows r..r+3
    v[r] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s[r]), _mm512_castps_pd(s[r + 2])));
    v[r + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s[r]), _mm512_castps_pd(s[r + 2])));
    v[r + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s[r + 1]), _mm512_castps_pd(s[r + 3])));
    v[r + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s[r + 1]), _mm512_castps_pd(s[r + 3])));
  }
  for (int c = 0; c < 4; ++c) {  // column 4l + c: lane l of v[c], v[4 + c], v[8 + c], v[12 + c]
    const __m512 x = _mm512_shuffle_f32x4(v[c], v[4 + c], 0x44), y = _mm512_shuffle_f32x4(v[c], v[4 + c], 0xEE);
    const __m512 z = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0x44), w = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0xEE);
    _mm512_storeu_ps(dst + c * MR, _mm512_shuffle_f32x4(x, z, 0x88));
    _mm512_storeu_ps(dst + (4 + c) * MR, _mm512_shuffle_f32x4(x, z, 0xDD));
    _mm512_storeu_ps(dst + (8 + c) * MR, _mm512_shuffle_f32x4(y, w, 0x88));
    _mm512_storeu_ps(dst + (12 + c) * MR, _mm512_shuffle_f32x4(y, w, 0xDD));
  }
}
// panel[q * MR + r] = A[q + r * lda] for q < kc, r < rows: op(A)'s rows as a panel of columns
__attribute__((target("avx512f"))) static void pack(const float* A, int64_t lda, int64_t rows, int64_t kc, float* panel) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t q0 = 0; q0 < kc; q0 += 16) {
      if (r0 + 16 <= rows && q0 + 16 <= kc) {
        transpose16(A + q0 + r0 * lda, lda, panel + q0 * MR + r0);
        continue;
      }
      for (int64_t q = q0; q < q0 + 16 && q < kc; ++q)
        for (int64_t r = r0; r < r0 + 16 && r < rows; ++r) panel[q * MR + r] = A[q + r * lda];
    }
}
__attribute__((target("avx512f"))) static void columns(
    const float* a, int64_t a_p, __mmask16 m0, __mmask16 m1, const float* b, int64_t b_p, int64_t b_j,
    int64_t kc, float* c, int64_t ldc, bool load_c, int64_t n) {
  int64_t j = 0;
  for (; j + NR <= n; j += NR) block<NR>(a, a_p, m0, m1, b + j * b_j, b_p, b_j, kc, c + j * ldc, ldc, load_c);
  if (j + 4 <= n) {
    block<4>(a, a_p, m0, m1, b + j * b_j, b_p, b_j, kc, c + j * ldc, ldc, load_c);
    j += 4;
  }
  for (; j < n; ++j) block<1>(a, a_p, m0, m1, b + j * b_j, b_p, b_j, kc, c + j * ldc, ldc, load_c);
}
// BLAS's sgemm_ (column-major) with alpha 1 and beta 0 or 1: C = op(A) op(B) (+ C). False where
// it leaves the product to sgemm_ (module docstring of small_gemm).
__attribute__((target("avx512f"))) static bool sgemm(
    bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
    const float* B, int64_t ldb, bool beta, float* C, int64_t ldc) {
  if ((ta && n < 2) || (SERIAL_MAX > 0 && m * n * k > SERIAL_MAX)) return false;
  alignas(64) float panel[KC * MR];
  const int64_t b_p = tb ? ldb : 1, b_j = tb ? 1 : ldb;
  for (int64_t i = 0; i < m; i += MR) {
    const int64_t rows = m - i < MR ? m - i : MR;
    const __mmask16 m0 = rows >= 16 ? 0xFFFF : (__mmask16)((1u << rows) - 1);
    const __mmask16 m1 = rows >= 32 ? 0xFFFF : rows > 16 ? (__mmask16)((1u << (rows - 16)) - 1) : 0;
    for (int64_t p = 0; p < k || (p == 0 && !beta); p += KC) {  // k == 0, beta 0: C = 0
      const int64_t kc = k - p < KC ? k - p : KC;
      const float* a = A + i + p * lda;
      int64_t a_p = lda;
      if (ta) {  // op(A)'s rows i.. as a panel: column q at panel + q * MR
        pack(A + p + i * lda, lda, rows, kc, panel);
        a = panel;
        a_p = MR;
      }
      columns(a, a_p, m0, m1, B + (tb ? p * ldb : p), b_p, b_j, kc, C + i, ldc, beta || p > 0, n);
      if (k == 0) break;
    }
  }
  return true;
}
}  // namespace scan_small_gemm
'''


def enabled():
    """Whether this process's loops compute their float32 BLAS products with ``SOURCE``'s gemm
    (module docstring: the CPU, MKL's path, the switches)."""
    forced = os.environ.get(ENV)
    if pipeline.is_off(NAME) or forced == "0" or not _avx512():
        return False
    return forced == "1" or not _mkl_takes_intel_path()


def source(threads):
    """``SOURCE`` for a process running ``threads`` intra-op threads."""
    return SOURCE % {"serial_max": 0 if threads <= _THREADS_ANY_SIZE else _SERIAL_MAX}


def call(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc):
    """The C++ condition that runs the product with ``SOURCE``'s gemm (true: done)."""
    return f"scan_small_gemm::sgemm({ta}, {tb}, {m}, {n}, {k}, {a}, {lda}, {b}, {ldb}, {beta}, {c}, {ldc})"


@functools.lru_cache(maxsize=None)
def _avx512():
    import torch

    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@functools.lru_cache(maxsize=None)
def _mkl_takes_intel_path():
    """MKL's own answer (``mkl_serv_intel_cpu_true``: its vendor check); True where it cannot be asked."""
    import ctypes

    check = torch_cpu_function("mkl_serv_intel_cpu_true")
    if check is None:
        return True
    check.restype = ctypes.c_int
    return bool(check())


def torch_cpu_function(name):
    """The C function ``name`` exported by torch's ``libtorch_cpu.so`` (where MKL is linked in), as a
    ctypes function; None where the library or the symbol is missing. Also ``blas``'s ``sgemm_`` check."""
    import ctypes

    import torch

    try:
        return getattr(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")), name)
    except (OSError, AttributeError):
        return None
