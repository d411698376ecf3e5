"""Hooks into the Python wrapper's extern kernel calls, for float32 matmuls in scan's counted loops
written as the BLAS call ATen's ``mm`` makes (which calls, and the kernels, are
``inductor.codegen.blas``'s: here only the patches that ask it).

torch 2.9 to 2.15: ``PythonWrapperCodegen.generate_extern_kernel_out(node)`` writing an
``ExternKernelOutLine(wrapper, node)`` whose ``codegen(code)`` calls the node's
``codegen_args()`` / ``codegen_reference()`` / ``output_view``; the wrapper's ``header``
(``splice``); ``V.graph.cpp_wrapper``.
"""


def write_extern_calls_as_kernels(plan_for, definition_of, line_of):
    """In the Python wrapper, write an extern kernel call (``extern_kernels.mm(a, b, out=c)``)
    for which ``plan_for(node)`` gives a plan as ``line_of(plan, args, out)`` (``args``: the
    node's argument references, ``out``: its output's), the kernel that line calls defined once
    per wrapper from ``definition_of(plan)`` (``(name, header text)``). Idempotent."""
    from torch._inductor.codegen.wrapper import ExternKernelOutLine, PythonWrapperCodegen
    from torch._inductor.virtualized import V

    if getattr(PythonWrapperCodegen.generate_extern_kernel_out, "_scan_blas", False):
        return
    generate_out = PythonWrapperCodegen.generate_extern_kernel_out
    line_codegen = ExternKernelOutLine.codegen

    def generate_extern_kernel_out(self, node):
        plan = None if V.graph.cpp_wrapper else plan_for(node)
        if plan is not None:
            name, definition = definition_of(plan)
            defined = self.__dict__.setdefault("_scan_blas_defined", set())
            if name not in defined:
                defined.add(name)
                self.header.splice(definition)
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
    PythonWrapperCodegen.generate_extern_kernel_out = generate_extern_kernel_out
    ExternKernelOutLine.codegen = codegen
