"""Inductor internals, as adapters: the post-grad scan pass and pattern matcher, the subgraph
lowering that scan's while_loops go through, and inductor's modules and classes handed to the
rooms that patch or read them (``inductor.workarounds``, ``inductor.wrapper_patches``,
``inductor.cpp_wrapper``, ``inductor.extern_rows``, ``inductor.codegen``).

Checked against torch 2.14's ``torch/_inductor``: ``post_grad`` still looks
``decompose_scan_to_while_loop`` up by name when its passes run, still has
``resolve_shape_to_proxy(shape, bound_symbols)`` (``inductor.lowering`` calls its core,
``sympy_interp``, through ``python_value_of``); ``PatternMatcherPass`` adds an optional ``subsystem``;
``SubgraphLowering.__init__`` still inherits the parent's ``bw_donated_idxs``
(the fix in ``inductor.workarounds`` is still needed).
"""
import functools


def post_grad_module():
    """``torch._inductor.fx_passes.post_grad`` (torch 2.9 to 2.15), whose
    module-level pass functions are looked up by name each compile."""
    from torch._inductor.fx_passes import post_grad

    return post_grad


def run_before_scan_decomposition(before):
    """Make inductor's post-grad pass ``decompose_scan_to_while_loop`` call
    ``before(gm)`` first, then upstream's pass. Not idempotent: call once.

    Inductor has no hook for a pass ahead of its scan decomposition; the
    module attribute is replaced (``post_grad`` looks it up at run time on
    torch 2.9 and 2.14 alike)."""
    post_grad = post_grad_module()
    upstream = post_grad.decompose_scan_to_while_loop

    @functools.wraps(upstream)
    def decompose_scans(gm):
        before(gm)
        return upstream(gm)

    post_grad.decompose_scan_to_while_loop = decompose_scans


def call_pattern_pass(target, extra_check, handler):
    """A pattern pass (``.apply(gm)``) that calls ``handler(match, *args,
    **kwargs)`` for each ``call_function`` node of ``target`` passing
    ``extra_check(match)``; ``match.nodes`` and ``match.replace_by_example``
    are the pattern matcher's. torch 2.9 to 2.15: ``torch._inductor.pattern_matcher``
    (2.14's PatternMatcherPass takes an optional ``subsystem``, unused here)."""
    from torch._inductor.pattern_matcher import (
        CallFunctionVarArgs,
        PatternMatcherPass,
        register_graph_pattern,
    )

    pass_ = PatternMatcherPass()
    register_graph_pattern(CallFunctionVarArgs(target), extra_check=extra_check, pass_dict=pass_)(handler)
    return pass_


def python_value_of(expr, env):
    """The sympy expression ``expr`` computed in Python from ``env`` ({symbol: value}; traced
    SymInts give traced values), as upstream's scan decomposition sizes its ys. torch 2.9 to 2.15:
    ``torch.utils._sympy.interp.sympy_interp(PythonReferenceAnalysis, env, expr)``."""
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    return sympy_interp(PythonReferenceAnalysis, env, expr)


def true_in_ranges(expr, ranges):
    """Whether the sympy relation ``expr`` is true for every value of its symbols in ``ranges``
    (``{symbol: (low, high)}``), as inductor's value-range analysis bounds it. torch 2.9 to 2.15:
    ``torch.utils._sympy.value_ranges.bound_sympy``, ``ValueRanges``."""
    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    bounds = bound_sympy(expr, {s: ValueRanges(lo, hi) for s, (lo, hi) in ranges.items()})
    return bounds.is_singleton() and bounds.lower == sympy.true


def run_after_subgraph_lowering_init(after):
    """Call ``after(lowering)`` at the end of every ``SubgraphLowering.__init__``
    (a while_loop's cond and body graphs are lowered by one). Not idempotent:
    call once. torch 2.9 to 2.15: ``torch._inductor.graph.SubgraphLowering``."""
    from torch._inductor.graph import SubgraphLowering

    init = SubgraphLowering.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        after(self)

    SubgraphLowering.__init__ = __init__


def ir():
    """``torch._inductor.ir`` (torch 2.9 to 2.15: ``NonOwningLayout``, ``ExternKernelOut``,
    ``Reduction``, ``ComputedBuffer``, ``StorageBox``, ``InputBuffer``, ``BaseView``,
    ``FlexibleLayout``, ``FixedLayout``, ``ExternKernel.convert_to_reinterpret_view`` and
    ``copy_input``, ``MultiOutput``, ``AssertScalar``, ``WhileLoop`` (``create``, a classmethod;
    ``_clone_aliased_inputs``, a staticmethod), ``is_storage_and_layout``)."""
    from torch._inductor import ir as ir_module

    return ir_module


def virtualized():
    """``torch._inductor.virtualized.V`` (``V.graph``: ``name``, ``current_node``, ``sizevars``,
    ``never_reuse_buffers``, ``unaligned_buffers``, ``removed_buffers``, ``mark_buffer_mutated``,
    ``cpp_wrapper``, ``aot_mode``, ``is_dual_wrapper_mode`` (2.15); ``V.aot_compilation``),
    torch 2.9 to 2.15."""
    from torch._inductor.virtualized import V

    return V


def config():
    """``torch._inductor.config`` (``cpp_wrapper``, ``patch``), torch 2.9 to 2.15."""
    from torch._inductor import config as config_module

    return config_module


def lowerings():
    """Inductor's lowering table, ``{op: lowering}`` (``torch._inductor.lowering.lowerings``)."""
    from torch._inductor.lowering import lowerings as table

    return table


def free_symbols(expr, unbacked_only):
    """``torch._inductor.utils.get_free_symbols(expr, unbacked_only)`` (torch 2.9 to 2.15)."""
    from torch._inductor.utils import get_free_symbols

    return get_free_symbols(expr, unbacked_only)


def wrapper_codegen():
    """``torch._inductor.codegen.wrapper`` (torch 2.9 to 2.15): ``PythonWrapperCodegen``,
    ``SubgraphPythonWrapperCodegen``, ``EnterSubgraphLine`` / ``ExitSubgraphLine``,
    ``ExternKernelOutLine``, ``AllocateLine``."""
    from torch._inductor.codegen import wrapper

    return wrapper


def cpp_wrapper_codegen():
    """The C++ wrapper's codegen class, ``torch._inductor.codegen.cpp_wrapper_cpu.CppWrapperCpu``
    (torch 2.9 to 2.15; a subclass of ``PythonWrapperCodegen``)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    return CppWrapperCpu


def cpp_codegen():
    """``torch._inductor.codegen.cpp``, inductor's C++ kernel codegen module. torch 2.9 (and the
    versions before 2.15) defines ``simplify_index_in_vec_range(index, var, vec_length)`` there
    (a ``functools.lru_cache``), looked up as a module global by its ``stride_at_vec_range`` when
    that runs; torch 2.15 moved both to ``sizevars`` (without the full ``sympy.simplify``)."""
    from torch._inductor.codegen import cpp

    return cpp


def scheduler():
    """``torch._inductor.scheduler.Scheduler`` (torch 2.9 to 2.15: ``should_partition``)."""
    from torch._inductor.scheduler import Scheduler

    return Scheduler


def fx_compile():
    """The class whose ``codegen_and_compile(gm, example_inputs, inputs_to_check, graph_kwargs)``
    runs inductor's post-grad passes and codegen, also in a compile subprocess: torch 2.9 to 2.15
    ``torch._inductor.compile_fx._InProcessFxCompile``."""
    from torch._inductor.compile_fx import _InProcessFxCompile

    return _InProcessFxCompile


def wrap_vector_tanh(choose):
    """Have inductor's C++ vector kernels write ``tanh(a)`` as ``choose(a, a.dtype, aten)``
    (``aten(a)``: what inductor writes itself). Idempotent. torch 2.9 to 2.15:
    ``torch._inductor.codegen.cpp.CppVecOverrides.tanh``, a staticmethod that
    ``CppVecOverrides.__new__`` wraps per instance (scalar operands go to ``CppOverrides``);
    its operands are ``CppCSEVariable`` s with a ``dtype``."""
    from torch._inductor.codegen.cpp import CppVecOverrides

    aten = CppVecOverrides.tanh
    if getattr(aten, "_scan_chosen", False):
        return

    def tanh(a):
        return choose(a, getattr(a, "dtype", None), aten)

    tanh._scan_chosen = True
    CppVecOverrides.tanh = staticmethod(tanh)


def vector_kernel_type(dtype):
    """The C++ vector type the C++ kernel being generated uses for ``dtype``
    (``at::vec::Vectorized<float>``, ``at::vec::VectorizedN<float,2>``), or None outside one.
    torch 2.9 to 2.15: ``V.kernel`` a ``CppVecKernel`` with ``_get_vec_type(dtype)``."""
    kernel = virtualized().kernel
    get = getattr(kernel, "_get_vec_type", None)
    return get(dtype) if get is not None else None


def vector_isa_name():
    """The vector ISA family inductor's C++ kernels are built for (``"avx512"``, also for AMX's
    ``"avx512 amx_tile"``; ``"avx2"``, ``"neon"``, ...; ``""`` without one): the first word of
    ``str(torch._inductor.cpu_vec_isa.pick_vec_isa())`` (torch 2.9 to 2.15, cached)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa() or "").split(" ")[0]


def _run_compile_command(line):
    """Run one compiler command line as inductor's ``run_compile_cmd`` does (split, no shell, in a
    scratch directory, output captured; a failure raises its ``CppCompileError``), but with the
    environment handed over explicitly.

    Why: our loop kernel builds on a worker thread while the main thread goes on, and inductor's
    ``CppPythonBindingsCodeCache._load_library_inner`` writes ``os.environ`` each time it loads a
    kernel. ``subprocess`` without ``env`` lets the child read the C ``environ`` after a (v)fork
    while that write frees the string it replaces: the compiler then failed to start now and then
    ("[Errno 14] Bad address: 'g++'", "cannot execute 'cc1plus'"). With ``env``, the child's
    environment is built before the fork from a copy of ``os.environ`` (torch 2.9 to 2.15:
    ``torch._inductor.exc.CppCompileError(cmd, output)``)."""
    import os
    import shlex
    import subprocess
    import tempfile

    from torch._inductor.exc import CppCompileError

    cmd = shlex.split(line)
    with tempfile.TemporaryDirectory() as cwd:
        try:
            subprocess.run(cmd, cwd=cwd, env=os.environ.copy(), check=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except subprocess.CalledProcessError as e:
            raise CppCompileError(cmd, e.stdout) from e


def build_cpp_pybinding(argtypes, source, build):
    """Start inductor's build of ``source`` as a ``cpp_pybinding`` kernel (its source file, flags,
    precompiled header, cache key, lock and loader), each of its C++ builds done by
    ``build(command, run, target)`` (``command``: inductor's command line, ``run(command)``: run a
    command line for it (``_run_compile_command``), ``target``: the file it makes), on inductor's compile thread pool
    (where it has one, else at the first ``result()``); none where the library is already on
    disk. Returns ``result()``: the loaded kernel, waiting for the build.

    torch 2.9 to 2.15: ``CppPythonBindingsCodeCache.load_pybinding_async(argtypes, source,
    submit_fn=)`` calls ``submit_fn(worker_fn)`` (only when the library is not built), with
    ``worker_fn`` a ``functools.partial(_worker_compile_cpp, lock_path, builders)``, and runs
    ``worker_fn()`` again when loading (a no-op once built); ``CppBuilder.get_command_line()``,
    ``build()`` (replaced per builder), ``get_target_file_path()``; ``AsyncCompile.pool()``, ``get_compile_threads()``.
    A ``worker_fn`` of another shape is submitted as it is (inductor's own builds)."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    from torch._inductor.cpp_builder import CppBuilder

    def built_by_us(builder):
        command = builder.get_command_line()
        builder.build = lambda: build(command, _run_compile_command, builder.get_target_file_path())

    def submit(worker_fn):
        builders = worker_fn.args[1] if isinstance(worker_fn, functools.partial) and len(worker_fn.args) == 2 else ()
        for builder in builders if isinstance(builders, (list, tuple)) else ():
            if isinstance(builder, CppBuilder):
                built_by_us(builder)
        return AsyncCompile.pool().submit(worker_fn) if get_compile_threads() > 1 else None

    return CppPythonBindingsCodeCache.load_pybinding_async(argtypes, source, submit_fn=submit)
