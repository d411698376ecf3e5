"""THE two pipelines: every text pass over a generated wrapper, per wrapper kind, in the order it runs.

Each pass says what it works on (``wants``: our counted loops, which we write ourselves, so a graph
without a scan skips every pass) and which of inductor's lines it must be able to read
(``broken``: a reason when lines of that kind are there in a form it does not know, the sign of a
torch that writes them differently). ``pipeline.run`` then uses the wrapper as generated, with one
warning naming the pass. Order matters: the Python passes drop the counter's calls before pooling
buffers, pool before ``run_loops_as_one_kernel`` reads the pools, accumulate carried sums in place
in the loops it left to Python (its kernel does that itself, ``accumulate``), and release what finished loops
hold last (a loop run as one kernel binds no body variables); the C++ passes pool first (its set-up
goes in front of the ``for``, which the later passes expect).
"""
import re

from . import blas, carry_in_place, cpp_text, loop_kernel, python_text
from .pipeline import Pass, Pipeline

_PY_DEF = re.compile(r"^\w+ = async_compile\.cpp_pybinding\(")
_COUNT_STEP_CALL = "torch.ops.torch_scan_hop.count_step"
_CPP_CPU_EMPTY = "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided("


def _python_loops(code, context=None):
    """Whether ``code`` holds a counted loop we wrote (``for <loop>_step in range(n):``)."""
    return any(python_text._FOR.match(line) for line in code.split("\n"))


def _python_loops_or_calls(code, context=None):
    return _python_loops(code) or any(python_text.STEPS_CALL.match(line) for line in code.split("\n"))


def _unreadable_kernel_definitions(code, context=None):
    """A reason when a ``cpp_pybinding`` kernel's definition is not in the form the passes read
    (its signature and source on the lines up to ``''')``), else None."""
    lines = code.split("\n")
    for i, line in enumerate(lines):
        if not _PY_DEF.match(line):
            continue
        if not loop_kernel._DEF.match(line):
            return f"a kernel definition of another form: {line[:120]!r}"
        if not any(lines[j] == "''')" for j in range(i + 1, len(lines))):
            return f"a kernel definition with no closing line \"''')\": {line[:120]!r}"
    return None


def _loop_bodies(lines):
    """``(line index, indentation, loop name, body lines)`` of each counted loop of the Python wrapper."""
    for i, line in enumerate(lines):
        if loop := python_text._FOR.match(line):
            yield i, loop.group(1), loop.group(2), lines[i + 1:python_text._body_end(lines, i, loop.group(1))]


def _unreadable_counter_steps(code, context=None):
    """A reason when a counted loop's body steps a counter in a form ``drop_counter_steps``
    does not read (the only lines it rewrites are in such bodies)."""
    for _, _, _, body in _loop_bodies(code.split("\n")):
        for line in body:
            if _COUNT_STEP_CALL in line and not python_text._COUNT_STEP.match(line):
                return f"a counter step of another form: {line.strip()[:120]!r}"
    return None


def _unwritten_carries(code, context=None):
    """A reason when a counted loop's body does not hand each carried value on as
    ``<loop>[k] = value`` (how inductor writes an inlined subgraph's outputs): the pool's
    check of what a step hands on would then see nothing and pool buffers that live longer.
    Only loops that allocate CPU buffers (all the pass pools) are checked."""
    lines = code.split("\n")
    for i, indent, name, body in _loop_bodies(lines):
        if not any("empty_strided_cpu(" in b for b in body):
            continue  # nothing the pass could pool
        head = re.match(rf"^{indent}{name} = \[(.*)\]$", lines[i - 1]) if i else None
        if head is None:
            return f"the loop {name}'s list of carried values is not on the line before it"
        carried = len(loop_kernel._split(head.group(1)))  # top-level commas: an item may be a view call
        written = {int(m.group(1)) for b in body if (m := re.match(rf"^{indent}    {name}\[(\d+)\] = \S", b))}
        if written != set(range(carried)):
            return f"the loop {name}'s body writes back carried values {sorted(written)} of {carried}"
    return None


def _no_wait_line(code, context=None):
    if loop_kernel._WAIT in code.split("\n"):
        return None
    return f"no line {loop_kernel._WAIT!r} to define the loop's kernel on"


def _loops_and_kernels(code, context=None):
    return _python_loops(code) and any(loop_kernel._DEF.match(line) for line in code.split("\n"))


def _first(*checks):
    """The first reason any of ``checks`` gives."""
    def broken(code, context):
        return next((r for r in (c(code, context) for c in checks) if r is not None), None)
    return broken


PYTHON_WRAPPER = Pipeline("python", (
    Pass("drop_counter_inits", lambda code, _: python_text.drop_counter_inits(code), _python_loops,
         _unreadable_kernel_definitions),
    Pass("drop_counter_steps", lambda code, _: python_text.drop_counter_steps(code),
         lambda code, _: _python_loops(code) and _COUNT_STEP_CALL in code, _unreadable_counter_steps),
    Pass("pool_loop_buffers", lambda code, _: python_text.pool_loop_buffers(code), _python_loops,
         _unwritten_carries),
    Pass("run_loops_as_one_kernel", lambda code, _: loop_kernel.run_loops_as_one_kernel(code),
         _loops_and_kernels, _first(_unreadable_kernel_definitions, _no_wait_line)),
    Pass("accumulate_carries_in_place", lambda code, _: carry_in_place.accumulate_carries_in_place(code),
         lambda code, _: _python_loops(code) and ("extern_kernels.addmm(" in code or f"{blas._ADDMM}(" in code),
         lambda code, _: carry_in_place.unreadable_addmm(code)),
    Pass("release_finished_loops", lambda code, _: python_text.release_finished_loops(code),
         _python_loops_or_calls),
))


def _cpp_loops(code, context=None):
    return any(cpp_text._CPP_FOR.match(cpp_text._for_header(line)) for line in code.split("\n"))


def _unclosed_cpp_loops(code, context=None):
    """A reason when one of our C++ loops has no closing brace at its indentation."""
    lines = code.split("\n")
    for i, line in enumerate(lines):
        loop = cpp_text._CPP_FOR.match(cpp_text._for_header(line))
        if loop and f"{loop.group(1)}}}" not in lines[i + 1:]:
            return f"the loop {loop.group(2)} has no closing brace at its indentation"
    return None


def _unreadable_cpu_allocations(code, context=None):
    """A reason when a CPU allocation inside our loops (what ``pool_cpp_loop_buffers`` pools) is
    not in the form the pass reads."""
    lines = code.split("\n")
    for start, end in cpp_text._loop_bodies(lines):
        text = "\n".join(lines[start:end])
        reason = _unreadable_cpu_allocation_in(text)
        if reason is not None:
            return reason
    return None


def _unreadable_cpu_allocation_in(code):
    for line in code.split("\n"):
        text = line.strip()
        if text.startswith(_CPP_CPU_EMPTY) and "cached_torch_device_type_cpu" in text \
                and not cpp_text._CPP_EMPTY.match(text):
            return f"a CPU allocation of another form: {text[:160]!r}"
    return None


def _blas_wanted(code, context):
    return context.get("jit", False) and _cpp_loops(code) and blas.blas_is_atens_float32_mm()


CPP_WRAPPER = Pipeline("cpp", (
    Pass("pool_cpp_loop_buffers", lambda code, _: cpp_text.pool_cpp_loop_buffers(code), _cpp_loops,
         _first(_unclosed_cpp_loops, _unreadable_cpu_allocations)),
    Pass("inline_row_views", lambda code, _: cpp_text.inline_row_views(code), _cpp_loops),
    Pass("call_blas_for_mm", lambda code, context: cpp_text.call_blas_for_mm(code, context["decisions"]),
         _blas_wanted,
         lambda code, _: cpp_text.blas_mm_unplaceable(code)),
))
