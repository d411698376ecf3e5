"""Inductor's Python wrapper code for scan's counted loops: ``for step in range(n)`` with
the body's lines inlined, its counter read as ``step``.

A scan of static length ``n`` becomes a while_loop whose cond is ``counter < n``,
the counter starting at 0 and growing by 1 per iteration. Inductor's own codegen
pays per iteration, besides the body's kernels: a call of the cond subgraph (an
argument list, a bool buffer, a C++ kernel, a tensor-to-bool conversion), a call of
the body subgraph as a Python function with its argument list, and the body's
``counter.item()`` (a tensor read back, ~1 us). Measured on a tanh RNN (H=64,
B=8), that was 1.2-1.4x the compiled unrolled loop's step. Here the loop is a
Python ``for`` around the body's own lines (inlined as inductor inlines subgraphs
for AOTInductor: the body's buffers are scoped to the loop by its
``EnterSubgraphLine``), and the body's read of the counter is the loop variable.

Python wrapper only: a C++ wrapper has its own ``codegen_while_loop``, and dynamic
lengths and other loops go to inductor's codegen. torch 2.9-2.15:
``PythonWrapperCodegen.codegen_while_loop(while_loop, stack_output)``,
``codegen_subgraph_by_inlining``, ``codegen_dynamic_scalar(node)`` (``node.inputs``,
``node.keypath``, ``node.sym``), ``EnterSubgraphLine``/``ExitSubgraphLine``,
``ir.AssertScalar.codegen(wrapper)`` (``.scalar``), ``torch.utils._sympy.value_ranges``,
``PythonWrapperCodegen.generate(is_inference)`` returning the code as a ``ValueWithLineMap``
dataclass first (its ``value`` is rewritten by ``wrapper_text``'s passes; the FX wrapper's
GraphModule is left alone).
"""

import contextlib
import dataclasses

from .loop_kernel import run_loops_as_one_kernel
from .wrapper_text import drop_counter_inits, drop_counter_steps, pool_loop_buffers, release_finished_loops

_steps = {}  # name of an inlined body's counter input -> (the Python loop variable holding it, trip count)
_step_symbols = {}  # unbacked symbol read from such a counter -> the loop's trip count (its values: 0..n-1)


def run_counted_loops_as_for_loops(is_counted):
    """Generate ``for <loop>_step in range(n):`` around the inlined body of a while_loop
    whose cond graph is ``counter < n`` (``n`` an int), when ``is_counted(name)``
    accepts its cond subgraph's name. The caller promises that such loops' first
    carried input is a counter starting at 0 that the body reads and increases by 1,
    and that they run at least once (``n >= 1``). Not idempotent: call once."""
    from torch._inductor import config, ir
    from torch._inductor.codegen.wrapper import (
        EnterSubgraphLine,
        ExitSubgraphLine,
        PythonWrapperCodegen,
    )
    from torch._inductor.virtualized import V

    codegen = PythonWrapperCodegen.codegen_while_loop
    dynamic_scalar = PythonWrapperCodegen.codegen_dynamic_scalar

    def codegen_while_loop(self, while_loop, stack_output=False):
        cond = while_loop.cond_subgraph
        n = None
        if not stack_output and not V.graph.aot_mode and is_counted(cond.name):
            n = _trip_count(cond.graph_module)
        if not _counts_steps(n):
            return codegen(self, while_loop, stack_output)
        name = while_loop.get_name()
        body = while_loop.body_subgraph
        carried = [buf.codegen_reference() for buf in while_loop.carried_inputs]
        inputs = [f"{name}[{i}]" for i in range(len(carried))]
        inputs += [buf.codegen_reference() for buf in while_loop.additional_inputs]
        self.writeline(f"{name} = [{', '.join(carried)}]")
        self.writeline(f"for {name}_step in range({_trip_count_code(self, n)}):")
        self.writeline(EnterSubgraphLine(self, body.graph))
        with counting(body, f"{name}_step", n), config.patch("graph_partition", False):
            self.codegen_subgraph_by_inlining(body, inputs, inputs[:len(carried)])
        # the body's lines are planned with the outer graph's: a buffer the body's kernels
        # fused away must not be allocated there (a y's temporary, every step)
        V.graph.removed_buffers |= body.graph.removed_buffers
        self.writeline(ExitSubgraphLine(self))
        return None

    def codegen_dynamic_scalar(self, node):
        step = step_read_by(node)
        if step is None:
            return dynamic_scalar(self, node)
        self.writeline(f"{node.sym} = {step}")
        self.writeline(f"{node.get_name()} = None")
        return None

    def codegen_assert_scalar(self, wrapper):
        if not V.graph.cpp_wrapper and _implied_by_steps(self.scalar):
            return None
        return assert_scalar(self, wrapper)

    def generate(self, is_inference):
        result = generate_code(self, is_inference)
        code = result[0]
        if not isinstance(getattr(code, "value", None), str):  # FX wrapper codegen: a GraphModule
            return result
        pooled = pool_loop_buffers(drop_counter_steps(drop_counter_inits(code.value)))
        pooled = release_finished_loops(run_loops_as_one_kernel(pooled))
        if pooled == code.value:
            return result
        return (dataclasses.replace(code, value=pooled), *result[1:])

    generate_code = PythonWrapperCodegen.generate
    PythonWrapperCodegen.generate = generate
    PythonWrapperCodegen.codegen_while_loop = codegen_while_loop
    PythonWrapperCodegen.codegen_dynamic_scalar = codegen_dynamic_scalar
    assert_scalar = ir.AssertScalar.codegen
    ir.AssertScalar.codegen = codegen_assert_scalar


@contextlib.contextmanager
def counting(body, step, n):
    """While a counted loop's ``body`` is generated (both wrappers): a read of its counter
    (its first input) is the loop variable ``step`` (``step_read_by``), and the symbols
    so read range over ``0..n-1`` (``_implied_by_steps``). An enclosing loop's entries (a
    scan in a scan's body) stay."""
    counter = next(iter(body.graph.graph_inputs))
    outer_symbols = set(_step_symbols)
    _steps[counter] = (step, n)
    try:
        yield
    finally:
        del _steps[counter]
        for symbol in set(_step_symbols) - outer_symbols:
            del _step_symbols[symbol]


def counted_loop_trip_counts():
    """The trip counts (ints, or sympy expressions of dynamic lengths) of the counted loops whose
    body is being generated, outermost first; empty outside them (either wrapper)."""
    return [n for _, n in _steps.values()]


def step_read_by(node):
    """The loop variable a ``DynamicScalar`` ``node`` reads when it reads the counter of a
    loop being generated (recording its symbol's range), else None."""
    found = _steps.get(node.inputs[0].codegen_reference()) if len(node.keypath) == 0 else None
    if found is None:
        return None
    _step_symbols[node.sym] = found[1]
    return found[0]


def _implied_by_steps(cond):
    """Whether the runtime assert ``cond`` holds for every value of the loop variables it
    reads (``u0 >= 0``, ``u0 < n``: the body's index bounds): then it is left out, as
    four such checks a step cost about what the step's own Python lines do. With a
    dynamic trip count (``u0 < s0``), a relation linear in each loop variable holds for
    all its values when it holds at both ends (``0`` and ``s0 - 1``), which sympy decides
    from the size symbols' assumptions or not at all (the check then stays)."""
    import itertools

    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    symbols = getattr(cond, "free_symbols", None)
    steps = {s: _step_symbols[s] for s in symbols or () if s in _step_symbols}
    if not steps:
        return False
    if len(steps) == len(symbols) and all(isinstance(n, int) for n in steps.values()):
        bounds = bound_sympy(cond, {s: ValueRanges(0, n - 1) for s, n in steps.items()})
        return bounds.is_singleton() and bounds.lower == sympy.true
    if not isinstance(cond, sympy.core.relational.Relational):
        return False
    gap = cond.lhs - cond.rhs
    if any(not gap.is_polynomial(s) or sympy.degree(gap, s) > 1 for s in steps):
        return False
    return all(cond.subs(dict(zip(steps, ends))) is sympy.true
               for ends in itertools.product(*[(0, n - 1) for n in steps.values()]))


def _trip_count(cond_gm):
    """``n`` when ``cond_gm`` computes exactly ``arg0 < n``: an int, or the sympy expression
    of a dynamic length read as ``sym_size(arg, d)`` of one of its inputs (the scan's
    preallocated ys, whose first dim is the length); else None."""
    import torch

    nodes = [n for n in cond_gm.graph.nodes if n.op not in ("placeholder", "output")]
    if not nodes or len(nodes) > 2:
        return None
    lt = nodes[-1]
    first = next(iter(cond_gm.graph.find_nodes(op="placeholder")), None)
    if (lt.op != "call_function" or lt.target is not torch.ops.aten.lt.Scalar or len(lt.args) != 2
            or lt.args[0] is not first):
        return None
    (out,) = cond_gm.graph.find_nodes(op="output")
    results = out.args[0]
    if isinstance(results, (tuple, list)) and len(results) == 1:
        results = results[0]
    if results is not lt:
        return None
    bound = lt.args[1]
    if len(nodes) == 1:
        return bound if type(bound) is int else None
    size = nodes[0]
    if (bound is not size or size.target is not torch.ops.aten.sym_size.int
            or getattr(size.args[0], "op", None) != "placeholder"):
        return None
    val = size.meta.get("val")
    return val.node.expr if isinstance(val, torch.SymInt) else None


def _trip_count_code(wrapper, n):
    """``n`` as the wrapper's code: a literal, or the symbol's expression (a Python int
    or an ``int64_t`` that the wrapper computed from its inputs' sizes)."""
    return str(n) if isinstance(n, int) else wrapper.codegen_sizevar(n)


def _counts_steps(n):
    """Whether a counted loop of trip count ``n`` may be generated: a dynamic length
    (never 0 or 1 when Dynamo made it symbolic; a for loop of 0 steps is right anyway)
    or an int of at least 1."""
    return n is not None and (not isinstance(n, int) or n >= 1)
