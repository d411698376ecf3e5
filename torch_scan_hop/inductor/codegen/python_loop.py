"""Inductor's Python wrapper codegen patched for scan's counted loops: ``for step in range(n)``
with the body's lines inlined, its counter read as ``step``, and the finished wrapper's text handed
to a rewrite (``pipeline`` over ``passes.PYTHON_WRAPPER``). Which loops count is
``counted_loops``'s; ``hooks.install`` wires the two together.

The loop is a Python ``for`` around the body's own lines (inlined as inductor inlines subgraphs
for AOTInductor: the body's buffers are scoped to the loop by its ``EnterSubgraphLine``), and the
body's read of the counter is the loop variable. Python wrapper only: a C++ wrapper has its own
``codegen_while_loop`` (``cpp_loop``), and dynamic lengths and other loops go to inductor's codegen.

torch 2.9 to 2.15: ``PythonWrapperCodegen.codegen_while_loop(while_loop, stack_output)``,
``codegen_subgraph_by_inlining``, ``codegen_dynamic_scalar(node)`` (``node.inputs``,
``node.keypath``, ``node.sym``), ``EnterSubgraphLine``/``ExitSubgraphLine``,
``ir.AssertScalar.codegen(wrapper)`` (``.scalar``), ``PythonWrapperCodegen.generate(is_inference)``
returning the code as a ``ValueWithLineMap`` dataclass first (the FX wrapper's GraphModule is left
alone; ``CppWrapperCpu.generate`` calls this one through ``super()``: its text is ``cpp_loop``'s to
rewrite). Inductor's modules and classes are ``_compat.inductor``'s adapters.
"""
import dataclasses

from ... import _compat

_inductor = _compat.inductor


def run_counted_loops_as_for_loops(loops):
    """Generate ``for <loop>_step in range(n):`` around the inlined body of a while_loop for
    which ``loops.trip_count(cond_subgraph, "python")`` gives ``n``, with ``loops.counting(body,
    step, n)`` active while the body is generated; a dynamic scalar ``loops.step_read_by``
    names is that loop variable, and an assert ``loops.implied_by_steps`` accepts is left out.
    Not idempotent: call once."""
    ir, V, config, lines = _inductor.ir(), _inductor.virtualized(), _inductor.config(), _inductor.wrapper_codegen()
    python_wrapper = lines.PythonWrapperCodegen
    codegen = python_wrapper.codegen_while_loop
    dynamic_scalar = python_wrapper.codegen_dynamic_scalar
    assert_scalar = ir.AssertScalar.codegen

    def codegen_while_loop(self, while_loop, stack_output=False):
        n = None
        if not stack_output and not V.graph.aot_mode:
            n = loops.trip_count(while_loop.cond_subgraph, "python")
        if n is None:
            return codegen(self, while_loop, stack_output)
        name = while_loop.get_name()
        body = while_loop.body_subgraph
        carried = [buf.codegen_reference() for buf in while_loop.carried_inputs]
        inputs = [f"{name}[{i}]" for i in range(len(carried))]
        inputs += [buf.codegen_reference() for buf in while_loop.additional_inputs]
        self.writeline(f"{name} = [{', '.join(carried)}]")
        self.writeline(f"for {name}_step in range({loops.trip_count_code(self, n)}):")
        self.writeline(lines.EnterSubgraphLine(self, body.graph))
        with loops.counting(body, f"{name}_step", n), config.patch("graph_partition", False):
            self.codegen_subgraph_by_inlining(body, inputs, inputs[:len(carried)])
        # the body's lines are planned with the outer graph's: a buffer the body's kernels
        # fused away must not be allocated there (a y's temporary, every step)
        V.graph.removed_buffers |= body.graph.removed_buffers
        self.writeline(lines.ExitSubgraphLine(self))
        return None

    def codegen_dynamic_scalar(self, node):
        step = loops.step_read_by(node)
        if step is None:
            return dynamic_scalar(self, node)
        self.writeline(f"{node.sym} = {step}")
        self.writeline(f"{node.get_name()} = None")
        return None

    def codegen_assert_scalar(self, wrapper):
        if not V.graph.cpp_wrapper and loops.implied_by_steps(self.scalar):
            return None
        return assert_scalar(self, wrapper)

    python_wrapper.codegen_while_loop = codegen_while_loop
    python_wrapper.codegen_dynamic_scalar = codegen_dynamic_scalar
    ir.AssertScalar.codegen = codegen_assert_scalar


def rewrite_generated_python_wrapper(rewrite):
    """Hand the Python wrapper's generated text to ``rewrite(text) -> text`` before inductor
    compiles it. Not the C++ wrapper's (``cpp_loop.rewrite_generated_cpp_wrapper``) nor the FX
    wrapper's (a GraphModule). Not idempotent: call once."""
    python_wrapper, cpp_wrapper = _inductor.wrapper_codegen().PythonWrapperCodegen, _inductor.cpp_wrapper_codegen()
    generate_code = python_wrapper.generate

    def generate(self, is_inference):
        result = generate_code(self, is_inference)
        code = result[0]
        if isinstance(self, cpp_wrapper) or not isinstance(getattr(code, "value", None), str):
            return result
        new = rewrite(code.value)
        if new == code.value:
            return result
        return (dataclasses.replace(code, value=new), *result[1:])

    python_wrapper.generate = generate
