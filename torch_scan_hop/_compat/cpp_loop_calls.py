"""Cheaper per-step calls in the C++ wrapper's counted loops (``cpp_loop``): the text of the
generated wrapper rewritten inside our ``for (int64_t <loop>_step ...)`` loops only.

What a step of the tanh RNN (H=64, B=8, one thread) cost in the C++ wrapper besides its two
kernels, from ``perf``: ~1 us of its ~2.55 us. ``aoti_torch_cpu_mm_out`` goes through the shim
into ATen's ``mm_out`` (structured meta checks, ``addmm_impl_cpu_``'s layout decisions,
``resolve_conj`` copies of the operands' handles, two string-keyed precision look-ups in
``cpublas::gemm``) before MKL's ``sgemm_`` does its 0.5 us of work; a row of ys read through
``reinterpret_tensor`` makes and frees a ``TensorImpl`` only for its data pointer. Two rewrites:

- ``aoti_torch_cpu_mm_out(out, a, b)`` becomes ``scan_blas_mm_out(out, a, b)``: for float32
  CPU matrices it makes the ``sgemm_`` call ATen would make (``addmm_impl_cpu_`` with
  ``beta=0, alpha=1``, then ``cpublas::gemm``'s ``normalize_last_dims`` and
  ``use_blas_gemm``), so the numbers are ATen's to the bit; any other case (another dtype, a
  size 0, a layout ATen would copy first, a leading dimension past ``int``) calls
  ``aoti_torch_cpu_mm_out`` as before. Only where ATen's float32 mm is that BLAS call: the
  JIT C++ wrapper (an AOTInductor package keeps the shim), x86 with MKL, ``sgemm_`` exported
  by libtorch_cpu, and the float32 matmul precision at ``ieee`` when the graph is compiled
  (``torch.set_float32_matmul_precision("medium")`` sends ATen's mm to oneDNN's bf16 path;
  changing it after the compile is not seen by the compiled loop).
- ``auto v = wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper(base, ..., offset));``
  whose ``v`` is only read as ``(T*)(v.data_ptr())`` becomes ``((T*)(base.data_ptr()) +
  (offset))`` at those reads (the view keeps its base's dtype and adds ``offset`` elements to
  its storage offset), as long as ``base`` is not reset or reassigned in between.

Measured on that RNN at T=1024 (interleaved rounds, CPU time): 2.55 -> 1.70 us a step, the
same outputs bit for bit. Lines are replaced in place (the helper goes at the front of the
``inductor_entry_impl`` line), so the code keeps its line count.

torch 2.9-2.15: the shim's ``aoti_torch_get_{dtype,device_type,dim,sizes,strides,data_ptr}``,
``aoti_torch_dtype_float32``, ``aoti_torch_device_type_cpu``, ``aoti_torch_cpu_mm_out``; the
wrapper's ``reinterpret_tensor_wrapper``. Whether ATen's mm is that BLAS call: ``loop_blas``.
"""
import re

from .cpp_loop import _CPP_FOR
from .loop_blas import blas_is_atens_float32_mm

BLAS_MM_OUT = (
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
    "sgemm_(&transa, &transb, &m_, &n_, &k_, &one, static_cast<const float*>(m1.data), &lda_, "
    "static_cast<const float*>(m2.data), &ldb_, &zero, static_cast<float*>(c.data), &ldc_); "
    "return AOTI_TORCH_SUCCESS; } } "  # the end of an anonymous namespace (no // comment: the line goes on)
)
_ENTRY = "void inductor_entry_impl("
_MM_OUT = re.compile(r"\baoti_torch_cpu_mm_out\(")
_ALIAS = re.compile(r"^auto (\w+) = wrap_with_raii_handle_if_needed\(reinterpret_tensor_wrapper\((\w+), \d+, "
                    r"\w+, \w+, ([^;]*)\)\);  // alias$")


def cheapen_cpp_loop_calls_in_generated_code():
    """Apply ``cheapen_loop_calls`` to the JIT C++ wrapper's generated code (after
    ``cpp_loop.pool_cpp_loop_buffers_in_generated_code``, whose hook it wraps the same way).
    torch 2.9-2.15: ``CppWrapperCpu.generate(is_inference)`` returns the code first, a
    ``ValueWithLineMap``-like object whose ``value`` is the text; ``V.graph.aot_mode``.
    Idempotent."""
    import dataclasses

    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.virtualized import V

    generate = CppWrapperCpu.generate
    if getattr(generate, "_scan_cheapens", False):
        return

    def generate_cheaper(self, is_inference):
        result = generate(self, is_inference)
        code = result[0]
        if not isinstance(getattr(code, "value", None), str):
            return result
        aot = bool(getattr(V.graph, "aot_mode", True))
        cheaper = cheapen_loop_calls(code.value, blas=not aot and blas_is_atens_float32_mm())
        if cheaper == code.value:
            return result
        return (dataclasses.replace(code, value=cheaper), *result[1:])

    generate_cheaper._scan_cheapens = True
    CppWrapperCpu.generate = generate_cheaper


def cheapen_loop_calls(code, blas):
    """``code`` (a C++ wrapper) with, inside our counted loops, a row view read only through
    its data pointer replaced by pointer arithmetic and (``blas``) ``aoti_torch_cpu_mm_out``
    by ``scan_blas_mm_out``, whose definition then goes in front of ``inductor_entry_impl``.
    Line count unchanged."""
    lines = code.split("\n")
    loops = _loop_bodies(lines)
    if not loops:
        return code
    mm_calls = 0
    for start, end in loops:
        _inline_row_views(lines, start, end)
        if blas:
            for j in range(start, end):
                lines[j], n = _MM_OUT.subn("scan_blas_mm_out(", lines[j])
                mm_calls += n
    entry = next((j for j, line in enumerate(lines) if line.startswith(_ENTRY)), None)
    if mm_calls and entry is not None:
        lines[entry] = BLAS_MM_OUT + lines[entry]
    elif mm_calls:  # nowhere to define it: leave the calls as they were
        return cheapen_loop_calls(code, blas=False)
    return "\n".join(lines)


def _loop_bodies(lines):
    """``[(first body line, closing line)]`` of our counted loops (nested ones overlap)."""
    bodies = []
    for i, line in enumerate(lines):
        loop = _CPP_FOR.match(_for_header(line))
        if loop is None:
            continue
        close = f"{loop.group(1)}}}"
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == close), None)
        if end is not None:
            bodies.append((i + 1, end))
    return bodies


def _for_header(line):
    """The ``for (...) {`` part of a line (the buffer pool puts its set-up in front of it),
    with the line's indentation."""
    indent = line[:len(line) - len(line.lstrip())]
    at = line.find("for (int64_t ")
    return "" if at < 0 else indent + line[at:]


def _inline_row_views(lines, start, end):
    for j in range(start, end):
        m = _ALIAS.match(lines[j].strip())
        if m is None:
            continue
        var, base, offset = m.groups()
        uses = [k for k in range(j + 1, end) if re.search(rf"\b{var}\b", lines[k])]
        reads = re.compile(rf"\((\w+)\*\)\({var}\.data_ptr\(\)\)")
        if not uses or any(re.search(rf"\b{var}\b", reads.sub("", lines[k])) for k in uses):
            continue  # read some other way (a handle passed to an extern kernel, an output)
        if any(re.search(rf"\b{base}(\.reset\(\)| = )", lines[k]) for k in range(j + 1, uses[-1] + 1)):
            continue  # its base may be gone by then
        indent = lines[j][:len(lines[j]) - len(lines[j].lstrip())]
        lines[j] = f"{indent}// {var}: {base}'s data + {offset}, read through its pointer only"
        for k in uses:
            lines[k] = reads.sub(lambda r: f"(({r.group(1)}*)({base}.data_ptr()) + ({offset}))", lines[k])
