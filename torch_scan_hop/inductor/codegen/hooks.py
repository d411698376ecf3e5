"""Where the codegen package meets inductor: the ``_compat`` hooks installed with this package's
decisions and pipelines as their callbacks, in the one order they must go in."""
from ... import _compat
from . import blas, counted_loops, passes, pipeline


def install(is_ours):
    """Counted loops for the while_loops whose cond subgraph's name ``is_ours(name)`` accepts,
    in both wrappers; the two text pipelines; float32 matmuls in those loops as BLAS calls. Install
    after ``_compat.cpp_wrapper.name_mutated_carries_in_cpp_while_loops`` (the C++ loop wraps the
    ``codegen_while_loop`` then installed). Not idempotent: ``lowering.install`` calls it once."""
    counted_loops.count_loops_named(is_ours)
    _compat.inductor_loop.run_counted_loops_as_for_loops(counted_loops)
    _compat.cpp_loop.run_counted_loops_as_cpp_for_loops(counted_loops)
    _compat.inductor_loop.rewrite_generated_python_wrapper(rewrite_python_wrapper)
    _compat.cpp_loop.rewrite_generated_cpp_wrapper(rewrite_cpp_wrapper)
    _compat.loop_blas.write_extern_calls_as_kernels(plan_blas_call, blas.kernel_definition, blas.call_line)


def rewrite_python_wrapper(code):
    """The Python wrapper's text after ``passes.PYTHON_WRAPPER``."""
    return pipeline.run(passes.PYTHON_WRAPPER, code)


def rewrite_cpp_wrapper(code, jit):
    """The C++ wrapper's text after ``passes.CPP_WRAPPER`` (``jit``: not an AOTInductor package)."""
    return pipeline.run(passes.CPP_WRAPPER, code, {"jit": jit})


def plan_blas_call(node):
    """``blas.plan_extern_call`` of an extern kernel ``node`` in the counted loops being generated
    (counted as ``blas_extern_calls`` where it is a matmul in such a loop)."""
    trip_counts = counted_loops.counted_loop_trip_counts()
    plan = blas.plan_extern_call(node, trip_counts)
    if trip_counts and getattr(node, "python_kernel_name", None) in blas.KINDS:
        pipeline.record("blas_extern_calls", "applied" if plan is not None else "skipped")
    return plan
