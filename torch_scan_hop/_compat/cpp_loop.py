"""Inductor's C++ wrapper code for scan's counted loops (``cpp_wrapper=True``,
AOTInductor): ``for (int64_t step = 0; step < n; ++step)`` around the body,
its counter read as ``step``.

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

torch 2.9-2.15: ``CppWrapperCpu.codegen_while_loop(while_loop, stack_output)``,
``codegen_subgraph(subgraph, outer_inputs, outer_outputs)``,
``codegen_tensor_item(dtype, tensor, scalar, indented_buffer=None)``,
``codegen_dynamic_scalar(node)`` (``node.inputs``, ``node.keypath``,
``node.sym``), ``unbacked_symbol_decls``, ``GraphLowering.is_dual_wrapper_mode``
(2.15 only).
"""
import re

from .inductor_loop import (
    _counts_steps,
    _trip_count,
    _trip_count_code,
    counting,
    step_read_by,
)
from .wrapper_text import _POOL_MAX_BYTES, _nbytes


def run_counted_loops_as_cpp_for_loops(is_counted):
    """The C++ wrapper's twin of ``inductor_loop.run_counted_loops_as_for_loops``:
    same contract (``is_counted(cond_name)`` accepts loops whose first carried input
    is a counter from 0 that the body reads and bumps by 1, and which run at least
    once). Install after ``cpp_wrapper.name_mutated_carries_in_cpp_while_loops``
    (it wraps whatever ``codegen_while_loop`` is then installed). Not idempotent:
    call once."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.virtualized import V

    codegen = CppWrapperCpu.codegen_while_loop
    dynamic_scalar = CppWrapperCpu.codegen_dynamic_scalar

    def codegen_while_loop(self, while_loop, stack_output=False):
        cond = while_loop.cond_subgraph
        n = None
        if not stack_output and not getattr(V.graph, "is_dual_wrapper_mode", False) and is_counted(cond.name):
            n = _trip_count(cond.graph_module)
        if not _counts_steps(n):
            return codegen(self, while_loop, stack_output)
        name = while_loop.get_name()
        step = f"{name}_step"
        with counting(while_loop.body_subgraph, step, n), \
                _answering(self, cond, name, step, _trip_count_code(self, n)):
            return codegen(self, while_loop, stack_output)

    def codegen_dynamic_scalar(self, node):
        step = step_read_by(node)
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


def pool_cpp_loop_buffers_in_generated_code():
    """Apply ``pool_cpp_loop_buffers`` to the C++ wrapper's generated code (the
    Python wrapper's twin is ``wrapper_text.pool_loop_buffers``). torch 2.9-2.15:
    ``CppWrapperCpu.generate(is_inference)`` returns the code first, as a
    ``ValueWithLineMap``-like object whose ``value`` is the text. Idempotent."""
    import dataclasses

    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    generate = CppWrapperCpu.generate
    if getattr(generate, "_scan_pools", False):
        return

    def generate_pooled(self, is_inference):
        result = generate(self, is_inference)
        code = result[0]
        if not isinstance(getattr(code, "value", None), str):
            return result
        pooled = pool_cpp_loop_buffers(code.value)
        if pooled == code.value:
            return result
        return (dataclasses.replace(code, value=pooled), *result[1:])

    generate_pooled._scan_pools = True
    CppWrapperCpu.generate = generate_pooled


_CPP_FOR = re.compile(r"^( *)for \(int64_t (\w+)_step = 0; \2_step < (\w+); \+\+\2_step\) \{$")
_CPP_ARRAY = re.compile(r"static constexpr int64_t (\w+)\[\] = \{([^}]*)\};")
_CPP_EMPTY = re.compile(r"^AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_empty_strided\((\d+), (\w+), (\w+), "
                        r"cached_torch_dtype_(\w+), (cached_torch_device_type_cpu), +0, &(\w+)_handle\)\);$")
_CPP_TAKE = re.compile(r"^AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_assign_tensors_out\((\w+), &(\w+)_handle\)\);$")
_CPP_GIVE = re.compile(r"^(\w+) = std::move\((\w+)\);$")
_CPP_REUSE = re.compile(r"^auto (\w+) = std::move\((\w+)\);  // reuse$")


def pool_cpp_loop_buffers(code):
    """The C++ wrapper ``code`` with the CPU buffers our counted loops allocate every
    iteration taken from two per allocation line, allocated before the loop and
    used by turns: ``aoti_torch_empty_strided`` (~0.3 us, a dispatcher call and a
    malloc) becomes a new handle on a pooled tensor (~0.02 us). Same rule as the
    Python wrapper's ``pool_loop_buffers``: two buffers suffice when every output
    of the body is a buffer it allocated or the carried input at the same
    position; otherwise the loop is left alone."""
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
        elif (m := _CPP_REUSE.match(text)) and m.group(2) in fresh:
            fresh.add(m.group(1))
        j += 1
    if j == len(lines) or not outputs:
        return []
    for outer, var in outputs:
        if taken.get(var) != outer and var not in fresh:
            return []
    return allocs
