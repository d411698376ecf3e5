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
dataclass first (its ``value`` is rewritten by ``drop_counter_inits``, ``pool_loop_buffers`` and
``release_finished_loops``; the FX wrapper's
GraphModule is left alone).
"""

import contextlib
import dataclasses
import re

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
        pooled = release_finished_loops(pool_loop_buffers(drop_counter_steps(drop_counter_inits(code.value))))
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


_ONE_STORE = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\['int64_t\*'\], r?'''$")  # torch 2.15 writes r'''
_CALL_ONE = re.compile(r"^( *)(\w+)\((\w+)\)$")


def drop_counter_inits(code):
    """The generated wrapper ``code`` without the C++ kernels whose only work is to set the
    counter of a loop that runs as ``for <loop>_step in range(n)``.

    That loop reads its index from the Python loop variable, never from the counter
    (``codegen_dynamic_scalar`` above), yet the counter the lowering gave the while_loop
    (``torch.zeros``: inductor's own codegen, kept for dynamic lengths and the C++ wrapper,
    does read it) still got a kernel of its own in a forward graph: one more C++ file to
    build on the first call, one of three for the tanh RNN's forward. A kernel is dropped
    only when its one argument is an ``int64_t*`` (it can write nothing but that buffer)
    and every call of it passes the counter of such a loop; its definition stays as a
    tuple of its signature and source, so nothing is compiled and the line map holds."""
    lines = code.split("\n")
    defs = {m.group(1): i for i, line in enumerate(lines) if (m := _ONE_STORE.match(line))}
    if not defs:
        return code
    counters = set()
    for i, line in enumerate(lines[1:], 1):
        if loop := _FOR.match(line):
            head = re.match(rf"^{loop.group(1)}{loop.group(2)} = \[(\w+)[,\]]", lines[i - 1])
            if head:
                counters.add(head.group(1))
    calls = {}
    for i, line in enumerate(lines):
        if (m := _CALL_ONE.match(line)) and m.group(2) in defs:
            calls.setdefault(m.group(2), []).append((i, m.group(1), m.group(3)))
    for kernel, sites in calls.items():
        mentions = sum(len(re.findall(rf"\b{kernel}\b", line)) for line in lines)
        if mentions != 1 + len(sites) or any(arg not in counters for _, _, arg in sites):
            continue
        for i, indent, arg in sites:
            lines[i] = f"{indent}pass  # {kernel}({arg}): a for loop's counter, never read"
        first = defs[kernel]
        lines[first] = lines[first].replace("async_compile.cpp_pybinding(", "(", 1)
    return "\n".join(lines)


_COUNT_STEP = re.compile(r"^( *)torch\.ops\.torch_scan_hop\.count_step\.default\((\w+)\)$")


def drop_counter_steps(code):
    """The generated wrapper ``code`` without the ``count_step`` calls (``inductor.counter``)
    of loops that run as ``for <loop>_step in range(n)``: their index is the loop variable,
    and stepping a counter nothing reads costs an operator call (~3 us) per iteration. The
    counter is the body's first input (``<name> = <loop>[0]``)."""
    lines = code.split("\n")
    for i, line in enumerate(lines):
        loop = _FOR.match(line)
        if loop is None:
            continue
        indent, name = loop.group(1), loop.group(2)
        end = _body_end(lines, i, indent)
        first = re.compile(rf"^ *(\w+) = {name}\[0\]$")
        counter = next((m.group(1) for line in lines[i + 1:end] if (m := first.match(line))), None)
        for k in range(i + 1, end):
            if (m := _COUNT_STEP.match(lines[k])) and m.group(2) == counter:
                lines[k] = f"{m.group(1)}pass  # count_step({counter}): a for loop's counter, never read"
    return "\n".join(lines)


_POOL_MAX_BYTES = 1 << 20  # per buffer: above it an allocation costs little next to the kernels that fill it
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
_FOR = re.compile(r"^( *)for (\w+)_step in range\((\w+)\):$")
_ALLOC = re.compile(r"^(\w+) = empty_strided_cpu\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)$")


def pool_loop_buffers(code):
    """The generated wrapper ``code`` with the CPU buffers our counted loops allocate every
    iteration taken from two per loop, allocated once, used by turns.

    Measured on the tanh RNN's training step (H=64, B=8): a loop iteration's
    ``empty_strided_cpu`` calls cost 1.5-3 us of the backward step's ~15 us (a fresh
    64x64 weight-gradient buffer per step page-faults). Two buffers per allocation
    line suffice when nothing allocated in iteration i is alive in iteration i+2: the
    body's outputs are the next iteration's carried inputs, and a carried input that
    leaves as an output at another position (``(a, b) -> (b, a + b)``) would keep an
    iteration-i buffer alive longer, so a loop with such an output, or an output
    this cannot trace to an allocation (a view, an extern kernel's result), is left as
    it is. Line numbers do not change (the pools are created on the line before the
    ``for``), so inductor's line map stays right."""
    lines = code.split("\n")
    for i in range(len(lines) - 1, 0, -1):
        loop = _FOR.match(lines[i])
        if loop is None:
            continue
        indent, name, n = loop.group(1), loop.group(2), loop.group(3)
        if not lines[i - 1].startswith(f"{indent}{name} = ["):
            continue
        pools = _plan_pools(lines, i, indent + "    ", name)
        if not pools:
            continue
        slots = 1 if n == "1" else 2
        created = []
        for k, (j, var, call) in enumerate(pools):
            pool = f"{name}_pool{k}"
            created.append(f"{pool} = ({', '.join([call] * slots)},)")
            lines[j] = f"{indent}    {var} = {pool}[{name}_step & 1]" if slots == 2 else f"{indent}    {var} = {pool}[0]"
        lines[i - 1] += "; " + "; ".join(created)
    return "\n".join(lines)


def _plan_pools(lines, start, body_indent, name):
    """``[(line index, variable, allocation call)]`` of the loop at ``lines[start]`` whose
    buffers can be pooled, or [] if the loop's outputs do not allow it."""
    carried, fresh, outputs, allocs = {}, set(), [], []
    take = re.compile(rf"^(\w+) = {name}\[(\d+)\]$")
    give = re.compile(rf"^{name}\[(\d+)\] = (\w+)$")
    reuse = re.compile(r"^(\w+) = (\w+); del \2  # reuse$")
    j = start + 1
    while j < len(lines) and (not lines[j].strip() or lines[j].startswith(body_indent)):
        line = lines[j]
        if line.startswith(body_indent) and not line[len(body_indent)].isspace():
            text = line[len(body_indent):]
            if m := take.match(text):
                carried[m.group(1)] = int(m.group(2))
            elif m := give.match(text):
                outputs.append((int(m.group(1)), m.group(2)))
            elif m := _ALLOC.match(text):
                fresh.add(m.group(1))
                if _nbytes(m.group(2), m.group(3)) <= _POOL_MAX_BYTES:
                    allocs.append((j, m.group(1), text[len(m.group(1)) + 3:]))
            elif (m := reuse.match(text)) and m.group(2) in fresh:
                fresh.add(m.group(1))
        j += 1
    for position, var in outputs:
        if carried.get(var) != position and var not in fresh:
            return []
    return allocs


def _nbytes(shape, dtype):
    size = _ITEMSIZE.get(dtype)
    if size is None:
        return _POOL_MAX_BYTES + 1
    for d in shape.replace(" ", "").split(","):
        if d:
            size *= int(d)
    return size


def release_finished_loops(code):
    """The generated wrapper ``code`` with what a finished counted loop still holds deleted:
    the variables its inlined body left bound, and its list of carried values
    (``<loop> = [...]``) after its last use.

    A Python ``for`` leaves its body's variables bound after the loop: a body's inputs
    (``b_arg2_1 = buf5[2]``: a scan's stacked buffers among them) and its last buffers.
    Inductor frees the list when it frees the loop's outputs, but where none is read through
    it (a scan's stacked values, used by the buffers it was handed) never. In a loop nested
    in another loop's body both kept the last iteration's buffers alive into the next one:
    in traced ``remat="sqrt"``'s backward one block's saved activations twice (at T=4096 a
    fifth of the step's peak). Each ``del`` goes in front of a statement at the loop's
    indentation (body variables: the first after the loop; the list: the first after its
    last use). A name read anywhere after the loop, or a list inductor deletes itself, is
    left alone. Line numbers do not change."""
    lines = code.split("\n")
    for i in range(len(lines) - 1, -1, -1):  # inner loops first: their dels are then part of the outer body
        loop = _FOR.match(lines[i])
        if loop is None:
            continue
        indent, name = loop.group(1), loop.group(2)
        end = _body_end(lines, i, indent)
        later = "\n".join(lines[end:])
        bound = [v for v in _left_bound(lines[i + 1:end], indent + "    ") if not re.search(rf"\b{v}\b", later)]
        dels = {}
        if bound and (at := _next_statement(lines, end, indent)) is not None:
            dels[at] = [f"del {', '.join(bound)}"]
        if (at := _after_last_use(lines, end, indent, name)) is not None:
            dels.setdefault(at, []).append(f"del {name}")
        for at, stmts in dels.items():
            lines[at] = f"{indent}{'; '.join(stmts)}; {lines[at][len(indent):]}"
    return "\n".join(lines)


_ASSIGNED = re.compile(r"^(\w+) = ")
_DELETED = re.compile(r"(?:^|; )del (\w+(?:, \w+)*)")


def _body_end(lines, start, indent):
    j = start + 1
    while j < len(lines) and (not lines[j].strip() or lines[j].startswith(indent + " ")):
        j += 1
    return j


def _left_bound(body, body_indent):
    """Variables the body surely leaves bound: assigned by its own statements or in a
    ``with`` block of them (CUDA kernels run under a device guard), not deleted after.
    A name deleted in any nested block may be unbound at the end: it is left alone."""
    bound, headers = {}, []  # headers: (indent, opens a `with`) of the blocks around a line
    for line in body:
        if not line.strip() or not line.startswith(body_indent):
            continue
        depth = len(line) - len(line.lstrip())
        while headers and headers[-1][0] >= depth:
            headers.pop()
        text = line.strip().split("  #")[0]
        if (m := _ASSIGNED.match(text)) and all(is_with for _, is_with in headers):
            bound[m.group(1)] = None
        for m in _DELETED.finditer(text):
            for v in m.group(1).split(", "):
                bound.pop(v, None)
        if text.endswith(":"):
            headers.append((depth, text.startswith("with ")))
    return list(bound)


def _block(lines, start, indent):
    """Indices from ``start`` to the end of the block at ``indent`` (blank lines included)."""
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(indent)
                                and not lines[end][len(indent):len(indent) + 1].isspace()):
        end += 1
    return range(start, end)


def _next_statement(lines, start, indent):
    """The first line in the block from ``start`` a ``del`` can go in front of, or None."""
    for k in _block(lines, start, indent):
        text = lines[k][len(indent):]
        if text.strip() and not text.startswith("#") and not text.rstrip().endswith(":"):
            return k
    return None


def _after_last_use(lines, end, indent, name):
    """Where the list ``name`` of the loop whose body ends at ``end`` can be deleted, or None."""
    used = re.compile(rf"\b{name}\b")
    block = _block(lines, end, indent)
    last = None
    for k in block:
        if used.search(lines[k]):
            if re.search(rf"\bdel {name}\b", lines[k]):
                return None  # inductor deletes it itself
            last = k
    if any(used.search(line) for line in lines[block.stop:]):  # read in a deeper block, or after this one
        return None
    return _next_statement(lines, end if last is None else last + 1, indent)
