"""Float32 matmuls in scan's counted loops as the BLAS call ATen's ``mm`` makes, without
ATen's dispatch around it: the kernels' sources, ATen's layout decisions (``mm_plan``) and, for the
Python wrapper, which extern ``mm``/``addmm`` calls become such a kernel (``plan_extern_call``) and
the line that calls it (``call_line``); ``hooks`` patches them into inductor's codegen.
The C++ wrapper's text rewrite is ``cpp_text.call_blas_for_mm`` (its helper: ``mm_out_helper``, with
``small_gemm``'s product where ``cpp_prelude`` put that gemm's source in the wrapper's header).

A step of the tanh RNN (H=64, B=8, one thread) spends ~0.5 us in MKL's ``sgemm_`` and, around
it, ~0.9 us in ATen's ``mm_out`` (structured meta checks, ``addmm_impl_cpu_``'s layout
decisions, ``resolve_conj`` copies of the operands, string-keyed precision look-ups in
``cpublas::gemm``); from the Python wrapper ``extern_kernels.mm(a, b, out=c)`` adds Python's
argument parsing: ~2.3 us a call in all, against ~0.8 us for a C++ kernel call that makes the
``sgemm_`` call directly. The call is the one ``addmm_impl_cpu_(out, out, a, b, beta=0,
alpha=1)`` makes through ``cpublas::gemm`` (its ``normalize_last_dims`` and
``use_blas_gemm``), so the numbers are ATen's to the bit (except where ``small_gemm`` computes the
product: CPUs on which MKL runs no AVX-512); any case where ATen would do
something else (another dtype, a size 0, a layout it copies first, a leading dimension past
``int``) keeps ATen's mm. In the Python wrapper the backward's weight-gradient accumulation,
``addmm(g, a, b, alpha=1, beta=1, out=c)``, is the same: ``addmm_impl_cpu_`` copies ``g`` into
``c``, then calls ``sgemm_`` with beta 1 (``scan_blas_addmm``; the C++ wrapper keeps ATen's).
Only where ATen's float32 mm is that call (``blas_is_atens_float32_mm``): x86 Linux with MKL,
``sgemm_`` exported by libtorch_cpu, and the float32 matmul precision at ``ieee`` when the graph
is compiled (``torch.set_float32_matmul_precision("medium")`` sends ATen's mm to oneDNN's bf16
path; a change after the compile is not seen by the compiled loop). The JIT C++ wrapper only: an
AOTInductor package keeps the shim's mm.

torch 2.9 to 2.15: ``torch.backends.mkldnn.matmul.fp32_precision`` (and ``mkldnn.fp32_precision``,
``fp32_precision``); an extern kernel node's ``python_kernel_name``, ``inputs``, ``kwargs``,
``output_view`` and layouts (``get_layout()``: ``dtype``, ``device``, ``size``, ``stride``);
the shim's ``aoti_torch_get_{dtype,device_type,dim,sizes,strides,data_ptr}``,
``aoti_torch_dtype_float32``, ``aoti_torch_device_type_cpu``, ``aoti_torch_cpu_mm_out``.
"""
import functools

from . import pipeline, small_gemm

# The C++ wrapper's ``scan_blas_mm_out(out, a, b)``: for float32 CPU matrices the ``sgemm_`` call
# ATen's ``mm_out`` makes (``addmm_impl_cpu_`` with beta=0, alpha=1, then ``cpublas::gemm``), any
# other case ``aoti_torch_cpu_mm_out`` as before; ``mm_plan`` is the same decisions in Python.
# ``%(small_gemm_or)s``: nothing, or small_gemm's call in front of ``sgemm_`` (``mm_out_helper``).
_MM_OUT_HELPER = (
    'extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, '
    'const float*, const int*, const float*, const int*, const float*, float*, const int*); '
    "namespace { struct ScanMatrix { int64_t size[2]; int64_t stride[2]; void* data; }; "
    "inline bool scan_as_matrix(AtenTensorHandle t, ScanMatrix& m) { int32_t dtype, device; int64_t dim; "
    "int64_t *sizes, *strides; "
    "if (aoti_torch_get_dtype(t, &dtype) || dtype != aoti_torch_dtype_float32()) return false; "
    "if (aoti_torch_get_device_type(t, &device) || device != aoti_torch_device_type_cpu()) return false; "
    "if (aoti_torch_get_dim(t, &dim) || dim != 2) return false; "
    "if (aoti_torch_get_sizes(t, &sizes) || aoti_torch_get_strides(t, &strides)) return false; "
    "if (aoti_torch_get_data_ptr(t, &m.data)) return false; "
    "m.size[0] = sizes[0]; m.size[1] = sizes[1]; m.stride[0] = strides[0]; m.stride[1] = strides[1]; "
    "return m.size[0] > 0 && m.size[1] > 0; } "
    # addmm_impl_cpu_(out, out, a, b, beta=0, alpha=1), then cpublas::gemm (float): BLAS or nothing
    "AOTITorchError scan_blas_mm_out(AtenTensorHandle out, AtenTensorHandle a, AtenTensorHandle b) { "
    "ScanMatrix c, m1, m2; "
    "if (!scan_as_matrix(out, c) || !scan_as_matrix(a, m1) || !scan_as_matrix(b, m2) "
    "|| c.size[0] != m1.size[0] || c.size[1] != m2.size[1] || m1.size[1] != m2.size[0]) "
    "return aoti_torch_cpu_mm_out(out, a, b); "
    "bool tc; "
    "if (c.stride[0] == 1 && (c.size[1] == 1 || c.stride[1] >= c.size[0])) tc = false; "
    "else if (c.stride[1] == 1 && (c.size[0] == 1 || c.stride[0] >= c.size[1])) { std::swap(m1, m2); tc = true; } "
    "else return aoti_torch_cpu_mm_out(out, a, b); "
    "const int i0 = tc ? 1 : 0, i1 = tc ? 0 : 1; "
    "int64_t m = c.size[i0], n = c.size[i1], k = m1.size[i1]; bool ta, tb; "
    "if (m1.stride[i0] == 1 && m1.stride[i1] >= m) ta = false; "
    "else if (m1.stride[i1] == 1 && m1.stride[i0] >= k) ta = true; "
    "else return aoti_torch_cpu_mm_out(out, a, b); "
    "if (m2.stride[i0] == 1 && m2.stride[i1] >= k) tb = false; "
    "else if (m2.stride[i1] == 1 && m2.stride[i0] >= n) tb = true; "
    "else return aoti_torch_cpu_mm_out(out, a, b); "
    "int64_t lda = m1.stride[ta == tc ? 1 : 0], ldb = m2.stride[tb == tc ? 1 : 0], ldc = c.stride[tc ? 0 : 1]; "
    "if (n == 1) ldc = m; "  # cpublas::internal::normalize_last_dims
    "if (ta) { if (m == 1) lda = k; } else if (k == 1) lda = m; "
    "if (tb) { if (k == 1) ldb = n; } else if (n == 1) ldb = k; "
    "const int64_t big = 2147483647; "  # cpublas::use_blas_gemm
    "if (m > big || n > big || k > big || lda > big || ldb > big || ldc > big || lda < std::max<int64_t>(1, ta ? k : m) "
    "|| ldb < std::max<int64_t>(1, tb ? n : k) || ldc < std::max<int64_t>(1, m)) return aoti_torch_cpu_mm_out(out, a, b); "
    "const char transa = ta ? 'T' : 'N', transb = tb ? 'T' : 'N'; "
    "const int m_ = m, n_ = n, k_ = k, lda_ = lda, ldb_ = ldb, ldc_ = ldc; const float one = 1.f, zero = 0.f; "
    "%(small_gemm_or)ssgemm_(&transa, &transb, &m_, &n_, &k_, &one, static_cast<const float*>(m1.data), &lda_, "
    "static_cast<const float*>(m2.data), &ldb_, &zero, static_cast<float*>(c.data), &ldc_); "
    "return AOTI_TORCH_SUCCESS; } } "  # the end of an anonymous namespace (no // comment: the line goes on)
)
BLAS_MM_OUT = _MM_OUT_HELPER % {"small_gemm_or": ""}


def mm_out_helper(small):
    """The C++ wrapper's helper (one line, no newline): ``BLAS_MM_OUT``, or (``small``) the same with
    the product by ``small_gemm``'s kernel first (``sgemm_`` for the shapes it leaves), which needs
    ``cpp_prelude``'s source defined before it."""
    if not small:
        return BLAS_MM_OUT
    condition = small_gemm.call("ta", "tb", "m", "n", "k", "static_cast<const float*>(m1.data)", "lda",
                                "static_cast<const float*>(m2.data)", "ldb", "false", "static_cast<float*>(c.data)", "ldc")
    return _MM_OUT_HELPER % {"small_gemm_or": f"if (!{condition}) "}


def cpp_prelude(node, trip_counts):
    """``small_gemm``'s source (``(name, text)``) for the C++ wrapper's header, where ``node`` (an extern
    kernel generated in the body of counted loops of ``trip_counts``) is a float32 CPU ``mm`` that
    ``cpp_text.call_blas_for_mm`` hands to ``mm_out_helper`` and ``small_gemm.enabled()``; else None.
    It goes in the wrapper's header at codegen (as the Python wrapper's kernel definitions do), not
    by a text pass: lines added there would shift the wrapper's line map (``cpp_text``)."""
    import torch

    if getattr(node, "python_kernel_name", None) != "extern_kernels.mm" or not trip_counts:
        return None
    layout = node.get_layout()
    if layout.dtype != torch.float32 or layout.device.type != "cpu":
        return None
    if not blas_is_atens_float32_mm() or not small_gemm.enabled():
        return None
    return small_gemm.NAME, small_gemm.source(torch.get_num_threads())


SGEMM_ARGTYPES = ["float*", "const float*", "const float*"] + ["const int64_t"] * 8
SGEMM_KERNEL = r'''
#include <cstdint>%(prelude)s
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*, const int*);
// ATen's addmm_impl_cpu_(c, c, a, b, 0, 1) for float32 after its layout decisions (mm_plan)
extern "C" void kernel(float* c, const float* a, const float* b, const int64_t ta, const int64_t tb,
                       const int64_t m, const int64_t n, const int64_t k,
                       const int64_t lda, const int64_t ldb, const int64_t ldc)
{
    const char transa = ta ? 'T' : 'N', transb = tb ? 'T' : 'N';
    const int m_ = m, n_ = n, k_ = k, lda_ = lda, ldb_ = ldb, ldc_ = ldc;
    const float one = 1.f, zero = 0.f;
    %(small_gemm_or)ssgemm_(&transa, &transb, &m_, &n_, &k_, &one, a, &lda_, b, &ldb_, &zero, c, &ldc_);
}
'''
ADDMM_ARGTYPES = ["float*", "const float*", "const float*", "const float*"] + ["const int64_t"] * 14
ADDMM_KERNEL = r'''
#include <cstdint>%(prelude)s
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*, const int*);
// ATen's addmm_impl_cpu_(c, self, a, b, 1, 1) for float32: self copied into c (c = self is a no-op: the
// loop kernel accumulates a carried gradient in place), then the gemm with beta = 1 after its layout
// decisions (mm_plan)
extern "C" void kernel(float* c, const float* self, const float* a, const float* b, const int64_t ta, const int64_t tb,
                       const int64_t m, const int64_t n, const int64_t k,
                       const int64_t lda, const int64_t ldb, const int64_t ldc,
                       const int64_t rows, const int64_t cols, const int64_t c_row, const int64_t c_col,
                       const int64_t self_row, const int64_t self_col)
{
    if (c != self)
        for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < cols; ++j)
                c[i * c_row + j * c_col] = self[i * self_row + j * self_col];
    const char transa = ta ? 'T' : 'N', transb = tb ? 'T' : 'N';
    const int m_ = m, n_ = n, k_ = k, lda_ = lda, ldb_ = ldb, ldc_ = ldc;
    const float one = 1.f;
    %(small_gemm_or)ssgemm_(&transa, &transb, &m_, &n_, &k_, &one, a, &lda_, b, &ldb_, &one, c, &ldc_);
}
'''
_KERNEL = "scan_blas_sgemm"
_ADDMM = "scan_blas_addmm"
_INT_MAX = 2 ** 31 - 1


def blas_is_atens_float32_mm():
    """Whether ATen's float32 CPU mm is, right now, a plain ``sgemm_`` call."""
    import torch

    backends = torch.backends
    try:
        precisions = (backends.mkldnn.matmul.fp32_precision, backends.mkldnn.fp32_precision, backends.fp32_precision)
    except AttributeError:  # a torch before the fp32_precision settings
        return False
    return all(p in ("none", "ieee") for p in precisions) and _mkl_sgemm_exported()


@functools.lru_cache(maxsize=None)
def _mkl_sgemm_exported():
    import platform

    import torch

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not torch.backends.mkl.is_available():
        return False
    return small_gemm.torch_cpu_function("sgemm_") is not None


def mm_plan(out, a, b):
    """``(swap, ta, tb, m, n, k, lda, ldb, ldc)`` of the ``sgemm_`` call ATen makes for
    ``mm_out(out, a, b)`` (each a ``(sizes, strides)`` pair of 2 ints), its operands ``(b, a)``
    when ``swap``; None where ATen would do anything else first. The same decisions as
    ``BLAS_MM_OUT`` (C++, at run time)."""
    (cs, cst), m1, m2 = out, a, b
    if min(*cs, *m1[0], *m2[0]) <= 0 or cs[0] != m1[0][0] or cs[1] != m2[0][1] or m1[0][1] != m2[0][0]:
        return None
    if cst[0] == 1 and (cs[1] == 1 or cst[1] >= cs[0]):
        tc = False
    elif cst[1] == 1 and (cs[0] == 1 or cst[0] >= cs[1]):
        m1, m2, tc = m2, m1, True
    else:
        return None
    i0, i1 = (1, 0) if tc else (0, 1)
    m, n, k = cs[i0], cs[i1], m1[0][i1]
    ta = _transposed(m1[1], i0, i1, m, k)
    tb = _transposed(m2[1], i0, i1, k, n)
    if ta is None or tb is None:
        return None
    lda, ldb, ldc = m1[1][1 if ta == tc else 0], m2[1][1 if tb == tc else 0], cst[0 if tc else 1]
    if n == 1:  # cpublas::internal::normalize_last_dims
        ldc = m
    if ta:
        lda = k if m == 1 else lda
    elif k == 1:
        lda = m
    if tb:
        ldb = n if k == 1 else ldb
    elif n == 1:
        ldb = k
    if max(m, n, k, lda, ldb, ldc) > _INT_MAX or lda < max(1, k if ta else m) or ldb < max(1, n if tb else k) \
            or ldc < max(1, m):  # cpublas::use_blas_gemm
        return None
    return tc, ta, tb, m, n, k, lda, ldb, ldc


def _transposed(stride, i0, i1, rows, cols):
    """ATen's cast of an operand as a BLAS matrix: False (as is), True (transposed), None (copied)."""
    if stride[i0] == 1 and stride[i1] >= rows:
        return False
    if stride[i1] == 1 and stride[i0] >= cols:
        return True
    return None


_MIN_STEPS = 64  # the Python wrapper's kernel is one more C++ file to build on a cold cache


def plan_extern_call(node, trip_counts):
    """The plan (``_plan_of``) of an extern ``mm``/``addmm`` node of the Python wrapper generated
    in the body of counted loops of ``trip_counts`` (theirs, outermost first) that becomes a call
    of ``scan_blas_sgemm(c, a, b, <ints>)`` (``scan_blas_addmm(c, g, a, b, <ints>)``), else None.
    Only when the three are float32 CPU matrices of static sizes and strides,
    ``blas_is_atens_float32_mm()``, and the loops run at least ``_MIN_STEPS`` steps in all (or a
    dynamic number): the kernel is one more C++ build on a cold cache (+1.1-1.3 s on the first
    call at load 6, caches off), which ~1.5 us saved a step pays back only on long loops. The C++
    wrapper's twin (``cpp_text.call_blas_for_mm``) builds nothing more."""
    kind = getattr(node, "python_kernel_name", None)
    if kind not in KINDS or not _long_enough(trip_counts):
        return None
    plan = _plan_of(node, accumulates=kind == "extern_kernels.addmm")
    if plan is None:
        return None
    pipeline.record(small_gemm.NAME, "applied" if small_gemm.enabled() else "skipped")
    return kind, plan


def kernel_definition(plan):
    """``(name, the line of the wrapper's header that defines it)`` of the kernel ``plan`` calls."""
    name, argtypes, source = KINDS[plan[0]]
    source = kernel_source(source, accumulates=name == _ADDMM)
    return name, f"\n\n{name} = async_compile.cpp_pybinding({argtypes!r}, r'''{source}''')\n"


def kernel_source(template, accumulates):
    """``SGEMM_KERNEL`` / ``ADDMM_KERNEL`` (``template``) as this process builds it: the product by
    ``sgemm_``, or by ``small_gemm``'s kernel where ``small_gemm.enabled()`` (``sgemm_`` for the
    shapes it leaves)."""
    import torch

    if not small_gemm.enabled():
        return template % {"prelude": "", "small_gemm_or": ""}
    beta = "true" if accumulates else "false"
    condition = small_gemm.call("ta", "tb", "m", "n", "k", "a", "lda", "b", "ldb", beta, "c", "ldc")
    return template % {"prelude": small_gemm.source(torch.get_num_threads()), "small_gemm_or": f"if (!{condition}) "}


def call_line(plan, args, out):
    """The wrapper's line calling ``plan``'s kernel: ``args`` are the node's argument references
    (``codegen_args()``), ``out`` its output's."""
    kind, (mm, copy) = plan
    a, b = args[1:3] if copy else args[:2]
    first, second = (b, a) if mm[0] else (a, b)
    ints = ", ".join(str(int(v)) for v in mm[1:])
    if copy:
        extra = ", ".join(str(int(v)) for v in copy)
        return f"{_ADDMM}({out}, {args[0]}, {first}, {second}, {ints}, {extra})"
    return f"{_KERNEL}({out}, {first}, {second}, {ints})"


def _long_enough(counts):
    total = 1
    for n in counts:
        if not isinstance(n, int):
            return True  # a dynamic length
        total *= n
    return bool(counts) and total >= _MIN_STEPS


def _plan_of(node, accumulates):
    """``(mm_plan, None)`` of an ``mm`` node, ``(mm_plan, (rows, cols, out strides, self strides))``
    of an ``addmm(self, a, b, alpha=1, beta=1)`` node (self, broadcast to the output's shape as
    a Linear's bias is, copied into out first, then the gemm with beta 1, as ``addmm_impl_cpu_``),
    or None where ATen's call is not that."""
    import torch

    out = node.output_view or node
    if accumulates:
        if len(node.inputs) != 3 or node.kwargs != {"alpha": 1, "beta": 1}:
            return None
        operands = [out, *node.inputs]
    elif len(node.inputs) != 2 or node.kwargs:
        return None
    else:
        operands = [out, *node.inputs]
    shapes = []
    for i, x in enumerate(operands):
        layout = x.get_layout()
        dims = (1, 2) if accumulates and i == 1 else (2,)  # addmm's self: a Linear's bias is 1-D
        if layout.dtype != torch.float32 or layout.device.type != "cpu" or len(layout.size) not in dims:
            return None
        try:
            shapes.append((tuple(int(s) for s in layout.size), tuple(int(s) for s in layout.stride)))
        except TypeError:  # a symbolic size or stride
            return None
    if not blas_is_atens_float32_mm():
        return None
    if not accumulates:
        mm = mm_plan(*shapes)
        return None if mm is None else (mm, None)
    (sizes, strides), (self_sizes, self_strides) = shapes[0], _expanded(*shapes[1], shapes[0][0])
    mm = mm_plan(shapes[0], *shapes[2:])
    if mm is None or self_sizes != sizes:
        return None
    return mm, (*sizes, *strides, *self_strides)


def _expanded(sizes, strides, to):
    """``(sizes, strides)`` of addmm's ``self`` as ATen's ``addmm_out_cpu`` expands it to the
    output's sizes ``to`` before copying it in (``expand_size``): a broadcast dim gets stride 0."""
    sizes, strides = (1,) * (2 - len(sizes)) + sizes, (0,) * (2 - len(strides)) + strides
    if any(s != t and s != 1 for s, t in zip(sizes, to)):
        return sizes, strides
    return to, tuple(0 if s != t else st for s, t, st in zip(sizes, to, strides))


KINDS = {"extern_kernels.mm": (_KERNEL, SGEMM_ARGTYPES, SGEMM_KERNEL),
          "extern_kernels.addmm": (_ADDMM, ADDMM_ARGTYPES, ADDMM_KERNEL)}

