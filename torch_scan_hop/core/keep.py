"""Which recorded values an eager ``remat="min_cut"`` step keeps: the least recompute within a memory budget.

Traced, "min_cut" is functorch's partitioner, which never recomputes a matmul:
on a stack of ``tanh(linear(h))`` layers every layer's output is a matmul's
input, so it keeps one tensor per layer and saves no memory at all on the
benchmark body (4 of save_all's 5 values per step). Eager "min_cut" is a
memory-budget cut instead, as functorch's ``activation_memory_budget``: a step
keeps at most ``BUDGET`` of the bytes save_all keeps for it (its new carry
counted: every policy keeps it), choosing the values whose recomputation costs
the most, and recomputes the rest from the step's recipes (``core/cheap.py``).

The choice is a knapsack (bytes kept against recompute saved), solved greedily:
starting from recomputing everything, repeatedly keep the value that saves the
most recompute per byte while it fits. The cost of a recipe is the elements it
makes, a matmul-class call (``cheap.DOTS``) ``DOT_WEIGHT`` times that (views
none). On the benchmark body (5 saved values per step, the last the carry)
the budget leaves room for one value besides the carry: a middle layer's
output, so the backward re-runs 2 of the 4 matmuls (recompute_all: 3).

Whatever it keeps, every value stays computable from its recipes, so a plan
made for one step is correct for any other: plans are cached per step shape
(the functions called and the values saved), the search runs once per scan.
"""
BUDGET = 0.5  # of the bytes save_all keeps per step
DOT_WEIGHT = 64  # a matmul's cost per output element, in elementwise ops


def parents(args, out):
    """Recipe ids an argument template refers to (``cheap._Ref``s, found by their ``rid``)."""
    if hasattr(args, "rid"):
        out.add(args.rid)
    elif isinstance(args, dict):
        for v in args.values():
            parents(v, out)
    elif isinstance(args, (tuple, list)):
        for v in args:
            parents(v, out)
    return out


def recompute_cost(needed, kept, inputs, costs):
    """Cost of recomputing the ``needed`` recipes, stopping at ``kept`` ones (``inputs``: rid -> parents)."""
    total, seen, todo = 0, set(), [r for r in needed if r not in kept]
    while todo:
        rid = todo.pop()
        if rid in seen:
            continue
        seen.add(rid)
        total += costs[rid]
        todo.extend(p for p in inputs[rid] if p not in kept and p not in seen)
    return total


def choose(recipes, needed, free, costs, sizes, budget):
    """The recipe ids to keep: within ``budget`` bytes, greedily the most recompute saved per byte.

    ``recipes``: the step's [(func, args, kwargs)]; ``needed``: ids of the values the backward reads;
    ``free``: ids kept anyway (the new carry); ``costs``: id -> recompute cost; ``sizes``: id -> bytes,
    for the ids that may be kept (single-output, not views)."""
    inputs = [parents((args, kwargs), set()) for _, args, kwargs in recipes]
    kept = set(free)
    current = recompute_cost(needed, kept, inputs, costs)
    chosen = []
    while True:
        best, best_rate = None, 0.0
        for rid, size in sizes.items():
            if rid in kept or size > budget or size <= 0:
                continue
            gain = current - recompute_cost(needed, kept | {rid}, inputs, costs)
            if gain > 0 and gain / size > best_rate:
                best, best_rate = rid, gain / size
        if best is None:
            return chosen
        kept.add(best)
        chosen.append(best)
        budget -= sizes[best]
        current = recompute_cost(needed, kept, inputs, costs)
