"""Where the codegen package meets inductor: the patches of inductor's codegen (``python_loop``,
``cpp_loop`` and, here, ``write_extern_calls_as_kernels``) installed with this package's decisions
and pipelines as their callbacks, in the one order they must go in."""
from ... import _compat
from . import blas, counted_loops, cpp_loop, fast_tanh, passes, pipeline, python_loop


def install(is_ours):
    """Counted loops for the while_loops whose cond subgraph's name ``is_ours(name)`` accepts,
    in both wrappers; the two text pipelines; float32 matmuls in those loops as BLAS calls, and
    float32 vector ``tanh`` as ``fast_tanh``'s. Install after
    ``inductor.cpp_wrapper.name_mutated_carries_in_cpp_while_loops`` (the C++ loop wraps the
    ``codegen_while_loop`` then installed). Not idempotent: ``lowering.install`` calls it once."""
    counted_loops.count_loops_named(is_ours)
    python_loop.run_counted_loops_as_for_loops(counted_loops)
    cpp_loop.run_counted_loops_as_cpp_for_loops(counted_loops)
    python_loop.rewrite_generated_python_wrapper(rewrite_python_wrapper)
    cpp_loop.rewrite_generated_cpp_wrapper(rewrite_cpp_wrapper)
    write_extern_calls_as_kernels(plan_blas_call, blas.kernel_definition, blas.call_line, cpp_prelude)
    fast_tanh.install()


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


def cpp_prelude(node):
    """``blas.cpp_prelude`` of an extern kernel ``node`` in the counted loops a JIT C++ wrapper is
    generating (an AOTInductor package keeps the shim's mm: nothing)."""
    V = _compat.inductor.virtualized()
    if getattr(V.graph, "aot_mode", True):
        return None
    return blas.cpp_prelude(node, counted_loops.counted_loop_trip_counts())


def write_extern_calls_as_kernels(plan_for, definition_of, line_of, cpp_prelude_for):
    """In the Python wrapper, write an extern kernel call (``extern_kernels.mm(a, b, out=c)``)
    for which ``plan_for(node)`` gives a plan as ``line_of(plan, args, out)`` (``args``: the
    node's argument references, ``out``: its output's), the kernel that line calls defined once
    per wrapper from ``definition_of(plan)`` (``(name, header text)``). In the C++ wrapper, the
    text ``cpp_prelude_for(node)`` gives (``(name, C++ text)`` or None) goes in its header, once
    per wrapper, for its text passes to call (the call stays inductor's). Idempotent.

    torch 2.9 to 2.15: ``PythonWrapperCodegen.generate_extern_kernel_out(node)`` writing an
    ``ExternKernelOutLine(wrapper, node)`` whose ``codegen(code)`` calls the node's
    ``codegen_args()`` / ``codegen_reference()`` / ``output_view``; the wrapper's ``header``
    (``splice``), the C++ wrapper's too; ``V.graph.cpp_wrapper``, ``V.graph.aot_mode``."""
    wrapper, V = _compat.inductor.wrapper_codegen(), _compat.inductor.virtualized()
    python_wrapper, extern_line = wrapper.PythonWrapperCodegen, wrapper.ExternKernelOutLine
    if getattr(python_wrapper.generate_extern_kernel_out, "_scan_blas", False):
        return
    generate_out = python_wrapper.generate_extern_kernel_out
    line_codegen = extern_line.codegen

    def generate_extern_kernel_out(self, node):
        if V.graph.cpp_wrapper:
            plan, definition = None, cpp_prelude_for(node)
        else:
            plan = plan_for(node)
            definition = None if plan is None else definition_of(plan)
        if definition is not None:
            name, text = definition
            defined = self.__dict__.setdefault("_scan_blas_defined", set())
            if name not in defined:
                defined.add(name)
                self.header.splice(text)
        if plan is not None:
            node._scan_blas_plan = plan  # read by the ExternKernelOutLine written next
        return generate_out(self, node)

    def codegen(self, code):
        node = self.node
        plan = getattr(node, "_scan_blas_plan", None)
        if plan is None:
            return line_codegen(self, code)
        out = node.output_view.codegen_reference() if node.output_view else node.codegen_reference()
        code.writeline(line_of(plan, node.codegen_args(), out))
        return None

    generate_extern_kernel_out._scan_blas = True
    python_wrapper.generate_extern_kernel_out = generate_extern_kernel_out
    extern_line.codegen = codegen
