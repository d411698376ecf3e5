"""Inductor's C++ wrapper codegen (``cpp_wrapper=True``, AOTInductor) patched for scan's counted
loops: ``for (int64_t step = 0; step < n; ++step)`` around the body, its counter read as ``step``,
and the finished wrapper's text handed to a rewrite (``pipeline`` over ``passes.CPP_WRAPPER``:
buffer pools, cheaper per-step calls). Which loops count is ``counted_loops``'s; ``hooks.install``
wires the two together.

The C++ wrapper's own ``codegen_while_loop`` pays per iteration, besides the
body's kernels: the cond subgraph (an argument handle per carried value, a
fresh bool tensor, a C++ kernel for ``counter < n``, ``aoti_torch_item_bool``)
and the body's ``aoti_torch_item_int64`` of the counter. Measured on the tanh
RNN (H=64, B=8, T=256, one thread): 4.9 us a step against the Python
wrapper's for-loop's 5.9 us. The loop variable replaces both; the cond
subgraph is never generated (one kernel fewer to compile).

Rather than re-implementing the wrapper's loop (its carried-handle set-up,
torch 2.15's device-guard and dual-wrapper state), inductor's own
``codegen_while_loop`` runs with three of its calls answered differently:
the cond subgraph's codegen writes nothing, the tensor-to-bool read of its
result writes nothing, and the lines ``while (1) {`` / ``if (!cond) break;``
become the ``for`` header / nothing. Graphs in dual-wrapper mode (torch 2.15
AOTInductor with Triton kernels) keep inductor's loop.

torch 2.9 to 2.15: ``CppWrapperCpu.codegen_while_loop(while_loop, stack_output)``,
``codegen_subgraph(subgraph, outer_inputs, outer_outputs)``,
``codegen_tensor_item(dtype, tensor, scalar, indented_buffer=None)``,
``codegen_dynamic_scalar(node)`` (``node.inputs``, ``node.keypath``,
``node.sym``), ``unbacked_symbol_decls``, ``GraphLowering.is_dual_wrapper_mode``
(2.15 only). Inductor's classes are ``_compat.inductor``'s adapters.
"""
import dataclasses

from ... import _compat

_inductor = _compat.inductor


def run_counted_loops_as_cpp_for_loops(loops):
    """The C++ wrapper's twin of ``python_loop.run_counted_loops_as_for_loops``: same
    contract (``loops.trip_count(cond_subgraph, "cpp")`` names the loops and their trip
    counts). Install after ``inductor.cpp_wrapper.name_mutated_carries_in_cpp_while_loops`` (it
    wraps whatever ``codegen_while_loop`` is then installed). Not idempotent: call once."""
    CppWrapperCpu, V = _inductor.cpp_wrapper_codegen(), _inductor.virtualized()
    codegen = CppWrapperCpu.codegen_while_loop
    dynamic_scalar = CppWrapperCpu.codegen_dynamic_scalar

    def codegen_while_loop(self, while_loop, stack_output=False):
        cond = while_loop.cond_subgraph
        n = None
        if not stack_output and not getattr(V.graph, "is_dual_wrapper_mode", False):
            n = loops.trip_count(cond, "cpp")
        if n is None:
            return codegen(self, while_loop, stack_output)
        name = while_loop.get_name()
        step = f"{name}_step"
        with loops.counting(while_loop.body_subgraph, step, n), \
                _answering(self, cond, name, step, loops.trip_count_code(self, n)):
            return codegen(self, while_loop, stack_output)

    def codegen_dynamic_scalar(self, node):
        step = loops.step_read_by(node)
        if step is None:
            return dynamic_scalar(self, node)
        self.writeline(f"int64_t {node.sym} = {step};")
        self.unbacked_symbol_decls.add(str(node.sym))
        return None

    CppWrapperCpu.codegen_while_loop = codegen_while_loop
    CppWrapperCpu.codegen_dynamic_scalar = codegen_dynamic_scalar


class _answering:
    """Context in which ``wrapper`` (one C++ wrapper codegen object) writes the loop
    ``name`` as a ``for`` over ``step``: instance attributes shadow three of its
    methods; on exit those of an enclosing loop's context (a scan in a scan's
    body) are put back."""

    def __init__(self, wrapper, cond, name, step, n):
        self.wrapper, self.cond, self.n, self.step = wrapper, cond, n, step
        self.cond_result = f"{name}_cond_result"

    _ATTRS = ("codegen_subgraph", "codegen_tensor_item", "writeline")

    def __enter__(self):
        w, cls = self.wrapper, type(self.wrapper)
        self.saved = {attr: w.__dict__[attr] for attr in self._ATTRS if attr in w.__dict__}  # an outer loop's
        subgraph, item, writeline = cls.codegen_subgraph, cls.codegen_tensor_item, cls.writeline
        w.codegen_subgraph = lambda sub, *a: None if sub is self.cond else subgraph(w, sub, *a)
        w.codegen_tensor_item = lambda dtype, tensor, *a, **k: (
            None if tensor == self.cond_result else item(w, dtype, tensor, *a, **k))

        state = ["before"]  # then "head", "in cond", "after". The cond's Enter/ExitSubgraphLine go
        # too: its graph never gets a scheduler, which torch 2.15's memory planner reads between them

        def translated(line):  # the first ``while (1) {`` only: the body may hold inductor's own loops
            if state[0] == "before" and line == "while (1) {":
                state[0] = "head"
                line = f"for (int64_t {self.step} = 0; {self.step} < {self.n}; ++{self.step}) {{"
            elif isinstance(line, str):
                if line.startswith(f"if (!{self.cond_result}") and line.endswith("break;"):
                    return None
            elif state[0] == "head" and getattr(line, "graph", None) is self.cond.graph:
                state[0] = "in cond"  # EnterSubgraphLine(wrapper, cond graph)
                return None
            elif state[0] == "in cond" and type(line).__name__ == "ExitSubgraphLine":
                state[0] = "after"
                return None
            return writeline(w, line)

        w.writeline = translated
        return self

    def __exit__(self, *exc):
        for attr in self._ATTRS:
            self.wrapper.__dict__.pop(attr, None)
        self.wrapper.__dict__.update(self.saved)
        return False


def rewrite_generated_cpp_wrapper(rewrite):
    """Hand the C++ wrapper's generated text to ``rewrite(text, jit) -> text`` before inductor
    compiles it; ``jit`` is False for AOTInductor (a package, which keeps the shim's calls).
    torch 2.9 to 2.15: ``CppWrapperCpu.generate(is_inference)`` returns the code first, as a
    ``ValueWithLineMap``-like object whose ``value`` is the text; ``V.graph.aot_mode``. Not
    idempotent: call once."""
    CppWrapperCpu, V = _inductor.cpp_wrapper_codegen(), _inductor.virtualized()
    generate = CppWrapperCpu.generate

    def generate_rewritten(self, is_inference):
        result = generate(self, is_inference)
        code = result[0]
        if not isinstance(getattr(code, "value", None), str):
            return result
        new = rewrite(code.value, not bool(getattr(V.graph, "aot_mode", True)))
        if new == code.value:
            return result
        return (dataclasses.replace(code, value=new), *result[1:])

    CppWrapperCpu.generate = generate_rewritten
