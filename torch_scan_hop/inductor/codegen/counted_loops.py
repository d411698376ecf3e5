"""Which while_loops run as counted ``for`` loops, and what their bodies read while generated.

A scan of static length ``n`` becomes a while_loop whose cond is ``counter < n``, the counter
starting at 0 and growing by 1 per iteration (``lowering``). Inductor's own codegen pays per
iteration, besides the body's kernels: a call of the cond subgraph (an argument list, a bool
buffer, a C++ kernel, a tensor-to-bool conversion), a call of the body subgraph with its argument
list, and the body's ``counter.item()`` (a tensor read back, ~1 us). Measured on a tanh RNN (H=64,
B=8), that was 1.2-1.4x the compiled unrolled loop's step. Both wrappers instead write a ``for``
over the loop variable around the body (``python_loop``, ``cpp_loop``: the
hooks into inductor's codegen); this module decides which loops (``trip_count``) and answers
their hooks while a body is generated: a read of the counter is the loop variable
(``step_read_by``), and asserts that hold for every value of it are left out
(``implied_by_steps``).
"""
import contextlib
import itertools

import sympy
import torch

from ... import _compat
from . import pipeline

_ours = [lambda name: False]  # whether a cond subgraph's name is one of our loops' (``count_loops_named``)
_steps = {}  # name of an inlined body's counter input -> (the loop variable holding it, trip count)
_step_symbols = {}  # unbacked symbol read from such a counter -> the loop's trip count (its values: 0..n-1)


def count_loops_named(ours):
    """Generate the loops whose cond subgraph's name ``ours(name)`` accepts as counted loops. The
    caller promises that such loops' first carried input is a counter starting at 0 that the body
    reads and increases by 1, and that they run at least once (``n >= 1``)."""
    _ours[0] = ours


def trip_count(cond, wrapper_kind):
    """``n`` (an int, or the sympy expression of a dynamic length) when the while_loop whose cond
    subgraph is ``cond`` runs as a counted ``for`` loop in the ``wrapper_kind`` wrapper (counted
    as ``<kind>_for_loops`` in ``pipeline.pass_counts``), else None."""
    if not _ours[0](cond.name):
        return None
    n = _trip_count(cond.graph_module)
    counts = n is not None and (not isinstance(n, int) or n >= 1)
    pipeline.record(f"{wrapper_kind}_for_loops", "applied" if counts else "skipped")
    return n if counts else None


def trip_count_code(wrapper, n):
    """``n`` as the wrapper's code: a literal, or the symbol's expression (a Python int
    or an ``int64_t`` that the wrapper computed from its inputs' sizes)."""
    return str(n) if isinstance(n, int) else wrapper.codegen_sizevar(n)


@contextlib.contextmanager
def counting(body, step, n):
    """While a counted loop's ``body`` is generated (both wrappers): a read of its counter
    (its first input) is the loop variable ``step`` (``step_read_by``), and the symbols
    so read range over ``0..n-1`` (``implied_by_steps``). An enclosing loop's entries (a
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


def implied_by_steps(cond):
    """Whether the runtime assert ``cond`` holds for every value of the loop variables it
    reads (``u0 >= 0``, ``u0 < n``: the body's index bounds): then it is left out, as
    four such checks a step cost about what the step's own Python lines do. With a
    dynamic trip count (``u0 < s0``), a relation linear in each loop variable holds for
    all its values when it holds at both ends (``0`` and ``s0 - 1``), which sympy decides
    from the size symbols' assumptions or not at all (the check then stays)."""
    symbols = getattr(cond, "free_symbols", None)
    steps = {s: _step_symbols[s] for s in symbols or () if s in _step_symbols}
    if not steps:
        return False
    if len(steps) == len(symbols) and all(isinstance(n, int) for n in steps.values()):
        return _compat.inductor.true_in_ranges(cond, {s: (0, n - 1) for s, n in steps.items()})
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
