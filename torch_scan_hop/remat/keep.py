"""Which recorded values an eager ``remat="min_cut"`` step keeps: the least recompute within a memory budget.

Traced, "min_cut" is functorch's partitioner, which never recomputes a matmul:
on a stack of ``tanh(linear(h))`` layers every layer's output is a matmul's
input, so it keeps one tensor per layer and saves no memory at all on the
benchmark body (4 of save_all's 5 values per step). Eager "min_cut" is a
memory-budget cut instead, as functorch's ``activation_memory_budget``: a step
keeps at most ``BUDGET`` of the bytes save_all keeps for it (its new carry
counted: every policy keeps it), choosing the values whose recomputation costs
the most, and recomputes the rest from the step's recipes (``remat/recipes.py``).

The choice is a knapsack (bytes kept against recompute saved), solved greedily:
starting from recomputing everything, repeatedly keep the value that saves the
most recompute per byte while it fits. The cost of a recipe is the elements it
makes, a matmul-class call (``recipes.DOTS``) ``DOT_WEIGHT`` times that (views
none). On the benchmark body (5 saved values per step, the last the carry)
the budget leaves room for one value besides the carry: a middle layer's
output, so the backward re-runs 2 of the 4 matmuls (recompute_all: 3).

Whatever it keeps, every value stays computable from its recipes, so a plan
made for one step is correct for any other: plans are cached per step shape
(the functions called, the values saved and their bytes): the search runs
once per process, not once per training step.
"""
BUDGET = 0.5  # of the bytes save_all keeps per step
DOT_WEIGHT = 64  # a matmul's cost per output element, in elementwise ops
PLANS = {}  # (step shape, saved bytes) -> recipe ids to keep: a training loop's scans plan once


def remember(key, plan):
    if len(PLANS) >= 1024:  # bodies whose shape keeps changing: do not grow without bound
        PLANS.clear()
    PLANS[key] = plan
    return plan


def parents(args, out):
    """Recipe ids an argument template refers to (``recipes._Ref``s, found by their ``rid``)."""
    if hasattr(args, "rid"):
        out.add(args.rid)
    elif isinstance(args, dict):
        for v in args.values():
            parents(v, out)
    elif isinstance(args, (tuple, list)):
        for v in args:
            parents(v, out)
    return out


def _recomputed(needed, kept, inputs):
    """The recipe ids the backward evaluates, in descending order (a recipe's parents have smaller ids)."""
    marked = {r for r in needed if r not in kept}
    for rid in range(max(marked, default=-1), -1, -1):
        if rid in marked:
            marked.update(p for p in inputs[rid] if p not in kept)
    return sorted(marked, reverse=True)


def _gains(needed, kept, inputs, costs):
    """rid -> recompute saved by keeping it: the cost of the recipes only it leads the backward to
    (those it dominates, walking from the needed values towards the inputs), itself included."""
    order = _recomputed(needed, kept, inputs)
    root = -1
    idom, depth = {}, {root: 0}
    consumers = {}
    for rid in order:  # consumers (larger ids) first: one pass gives the dominators of a DAG
        preds = consumers.get(rid, [])
        if rid in needed:
            preds = preds + [root]
        dom = preds[0]
        for p in preds[1:]:
            a, b = dom, p
            while a != b:
                if depth[a] >= depth[b]:
                    a = idom[a]
                else:
                    b = idom[b]
            dom = a
        idom[rid], depth[rid] = dom, depth[dom] + 1
        for p in inputs[rid]:
            if p not in kept:
                consumers.setdefault(p, []).append(rid)
    gain = {rid: costs[rid] for rid in order}
    for rid in reversed(order):  # producers first: a subtree's sum before its root's
        if idom[rid] != root:
            gain[idom[rid]] += gain[rid]
    return gain


def choose(recipes, needed, free, costs, sizes, budget):
    """The recipe ids to keep: within ``budget`` bytes, greedily the most recompute saved per byte.

    ``recipes``: the step's [(func, args, kwargs)]; ``needed``: ids of the values the backward reads;
    ``free``: ids kept anyway (the new carry); ``costs``: id -> recompute cost; ``sizes``: id -> bytes,
    for the ids that may be kept (single-output, not views). Each round ranks every candidate by
    its dominator subtree (``_gains``): linear in the step's recipes, not one walk per candidate."""
    inputs = [parents((args, kwargs), set()) for _, args, kwargs in recipes]
    kept, chosen = set(free), []
    while True:
        gains = _gains(needed, kept, inputs, costs)
        best, best_rate = None, 0.0
        for rid, gain in gains.items():
            size = sizes.get(rid, 0)
            if 0 < size <= budget and gain > 0 and gain / size > best_rate:
                best, best_rate = rid, gain / size
        if best is None:
            return chosen
        kept.add(best)
        chosen.append(best)
        budget -= sizes[best]
