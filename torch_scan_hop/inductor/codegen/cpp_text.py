"""Text passes over inductor's generated C++ wrapper (``cpp_wrapper=True``, AOTInductor) inside
scan's counted loops, ``for (int64_t <loop>_step ...)`` (written by ``cpp_loop``); run in
the order ``passes.CPP_WRAPPER`` declares.

- ``pool_cpp_loop_buffers``: the CPU buffers a loop allocates every step taken from two per
  allocation line, made before the loop (the Python wrapper's twin is
  ``python_text.pool_loop_buffers``).
- ``inline_row_views``: a row view read only through its data pointer becomes pointer arithmetic
  on its base (no ``TensorImpl`` made and freed per step).
- ``call_blas_for_mm``: ``aoti_torch_cpu_mm_out`` becomes ``blas.mm_out_helper``'s
  ``scan_blas_mm_out``, ATen's own ``sgemm_`` call without ATen's dispatch around it (on CPUs
  where MKL runs no AVX-512, ``small_gemm``'s product first: its source is put in the wrapper's
  header at codegen, ``blas.cpp_prelude``, since the helper's one line cannot ``#include``).

What a step of the tanh RNN (H=64, B=8, one thread) cost besides its two kernels, from ``perf``:
~1 us of its ~2.55 us (``mm_out``'s checks and layout decisions around MKL's 0.5 us, a
``TensorImpl`` per row view); with the last two passes 1.70 us, the same outputs bit for bit
(interleaved rounds, T=1024). Lines are replaced in place (the BLAS helper goes at the front of
the ``inductor_entry_impl`` line), so the code keeps its line count.

torch 2.9 to 2.15: the shim's ``aoti_torch_empty_strided``, ``aoti_torch_assign_tensors_out``,
``aoti_torch_cpu_mm_out``; the wrapper's ``reinterpret_tensor_wrapper``,
``wrap_with_raii_handle_if_needed``, ``static constexpr int64_t`` size arrays.
"""
import re

from . import small_gemm
from .blas import mm_out_helper
from .python_text import _POOL_MAX_BYTES, _nbytes

_CPP_FOR = re.compile(r"^( *)for \(int64_t (\w+)_step = 0; \2_step < (\w+); \+\+\2_step\) \{$")
_CPP_ARRAY = re.compile(r"static constexpr int64_t (\w+)\[\] = \{([^}]*)\};")
_CPP_EMPTY = re.compile(r"^AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_empty_strided\((\d+), (\w+), (\w+), "
                        r"cached_torch_dtype_(\w+), (cached_torch_device_type_cpu), +0, &(\w+)_handle\)\);$")
_CPP_TAKE = re.compile(r"^AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_assign_tensors_out\((\w+), &(\w+)_handle\)\);$")
_CPP_GIVE = re.compile(r"^(\w+) = std::move\((\w+)\);$")
# a buffer handed on under another name, or as a view of it (a (1, n) sum read as (n,))
_CPP_REUSE = re.compile(r"^auto (\w+) = (?:std::move\((\w+)\)|wrap_with_raii_handle_if_needed\("
                        r"reinterpret_tensor_wrapper\((\w+), [^;]*\)\); \3\.reset\(\));  // reuse$")


def pool_cpp_loop_buffers(code):
    """The C++ wrapper ``code`` with the CPU buffers our counted loops allocate every
    iteration taken from two per allocation line, allocated before the loop and
    used by turns: ``aoti_torch_empty_strided`` (~0.3 us, a dispatcher call and a
    malloc) becomes a new handle on a pooled tensor (~0.02 us). Same rule as the
    Python wrapper's ``pool_loop_buffers``: two buffers suffice when every output
    of the body is a buffer it allocated (or a view inductor made of one in its
    place) or the carried input at the same position; otherwise the loop is left alone."""
    lines = code.split("\n")
    arrays = {m.group(1): m.group(2) for m in _CPP_ARRAY.finditer(code)}
    for i in range(len(lines) - 1, -1, -1):
        loop = _CPP_FOR.match(lines[i])
        if loop is None:
            continue
        indent, name = loop.group(1), loop.group(2)
        pools = _plan_cpp_pools(lines, i, indent, arrays)
        if not pools:
            continue
        created = []
        for k, (j, var, ndim, sizes, strides, dtype, device) in enumerate(pools):
            pool = f"{name}_pool{k}"
            created.append(
                f"static constexpr int64_t {pool}_sizes[] = {{{sizes}}}; "
                f"static constexpr int64_t {pool}_strides[] = {{{strides}}}; "
                f"RAIIAtenTensorHandle {pool}[2]; for (auto& {pool}_slot : {pool}) {{ AtenTensorHandle {pool}_raw; "
                f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided({ndim}, {pool}_sizes, {pool}_strides, "
                f"cached_torch_dtype_{dtype}, {device}, 0, &{pool}_raw)); {pool}_slot = RAIIAtenTensorHandle({pool}_raw); }}")
            body_indent = lines[j][:len(lines[j]) - len(lines[j].lstrip())]
            lines[j] = (f"{body_indent}AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_assign_tensors_out("
                        f"{pool}[{name}_step & 1], &{var}_handle));")
        lines[i] = indent + " ".join(created) + " " + lines[i].lstrip()
    return "\n".join(lines)


def _plan_cpp_pools(lines, start, indent, arrays):
    """``[(line index, variable, ndim, sizes, strides, dtype, device)]`` of the loop at
    ``lines[start]`` whose allocations can be pooled, or [] if its outputs do not
    allow it (or an allocation's shape is not a literal array of at most 1 MiB)."""
    taken, fresh, outputs, allocs = {}, set(), [], []
    j = start + 1
    own = None  # the body's own indentation: lines of a loop nested in it run several times a step
    while j < len(lines) and lines[j] != f"{indent}}}":
        text = lines[j].strip()
        depth = len(lines[j]) - len(lines[j].lstrip())
        own = depth if own is None and text else own
        if depth != own:
            j += 1
            continue
        if m := _CPP_TAKE.match(text):
            taken[m.group(2)] = m.group(1)
        elif m := _CPP_GIVE.match(text):
            outputs.append((m.group(1), m.group(2)))
        elif m := _CPP_EMPTY.match(text):
            fresh.add(m.group(6))
            sizes, strides = arrays.get(m.group(2)), arrays.get(m.group(3))
            if sizes is not None and strides is not None and _nbytes(sizes.replace("L", ""), m.group(4)) <= _POOL_MAX_BYTES:
                allocs.append((j, m.group(6), m.group(1), sizes, strides, m.group(4), m.group(5)))
        elif (m := _CPP_REUSE.match(text)) and (m.group(2) or m.group(3)) in fresh:
            fresh.add(m.group(1))
        j += 1
    if j == len(lines) or not outputs:
        return []
    for outer, var in outputs:
        if taken.get(var) != outer and var not in fresh:
            return []
    return allocs


_ENTRY = "void inductor_entry_impl("
_MM_OUT = re.compile(r"\baoti_torch_cpu_mm_out\(")
_ALIAS = re.compile(r"^auto (\w+) = wrap_with_raii_handle_if_needed\(reinterpret_tensor_wrapper\((\w+), \d+, "
                    r"\w+, \w+, ([^;]*)\)\);  // alias$")


def inline_row_views(code):
    """``code`` (a C++ wrapper) with, inside our counted loops, a row view read only through its
    data pointer replaced by pointer arithmetic on its base. Line count unchanged."""
    lines = code.split("\n")
    for start, end in _loop_bodies(lines):
        _inline_row_views(lines, start, end)
    return "\n".join(lines)


def call_blas_for_mm(code, decisions=None):
    """``code`` with, inside our counted loops, ``aoti_torch_cpu_mm_out`` called as
    ``scan_blas_mm_out``, whose definition goes in front of ``inductor_entry_impl`` (where that
    line is missing the code is returned as it is: ``blas_mm_unplaceable`` tells). Only where
    ATen's float32 mm is that BLAS call (``blas.blas_is_atens_float32_mm``, the caller's test).
    Where ``small_gemm``'s source is defined before that line (``blas.cpp_prelude``, put in the
    wrapper's header at codegen) the helper computes the product with it first; ``decisions``
    gets ``("small_gemm", "applied" / "skipped")`` per call rewritten."""
    lines = code.split("\n")
    mm_calls = 0
    for start, end in _loop_bodies(lines):
        for j in range(start, end):
            lines[j], n = _MM_OUT.subn("scan_blas_mm_out(", lines[j])
            mm_calls += n
    entry = _entry_line(lines)
    if not mm_calls or entry is None:
        return code
    small = small_gemm.NAMESPACE in lines[:entry]
    lines[entry] = mm_out_helper(small) + lines[entry]
    if decisions is not None:
        decisions.extend([(small_gemm.NAME, "applied" if small else "skipped")] * mm_calls)
    return "\n".join(lines)


def blas_mm_unplaceable(code):
    """A reason when ``code`` calls ``aoti_torch_cpu_mm_out`` in our loops but has no
    ``inductor_entry_impl`` line to put ``scan_blas_mm_out`` in front of, else None."""
    lines = code.split("\n")
    if _entry_line(lines) is not None:
        return None
    if any(_MM_OUT.search(lines[j]) for start, end in _loop_bodies(lines) for j in range(start, end)):
        return f"no line starts with {_ENTRY!r}"
    return None


def cheapen_loop_calls(code, blas):
    """``inline_row_views``, then (``blas``) ``call_blas_for_mm``: the two passes as the
    pipeline runs them."""
    code = inline_row_views(code)
    return call_blas_for_mm(code) if blas else code


def _entry_line(lines):
    return next((j for j, line in enumerate(lines) if line.startswith(_ENTRY)), None)


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
