"""A declared graph pass: a ``cond`` whose two branches trace to the same graph is its branch.

Layers that differ only in attributes their traced code never turns into ops (Gemma 3's
sliding and full attention layers hand ``sliding_window`` to an attention function that
ignores it under sdpa) run as one scan whose step picks each layer's code by its kind with
``torch.cond`` (``layers.alike``). When the branches trace alike, the choice is no
choice: the cond node is replaced by the ops of one branch, so the body's joint, partition
and compile see one layer, not two. Branches that differ keep their cond (each layer then
runs its own code, as the loop does). A cond is rewritten whole or left as it was; the
count of rewritten conds is ``counts()["inlined"]`` and of those kept ``counts()["kept"]``.
"""
import collections
import operator

import torch

from .cache import graph_key, resolve_attr

_counts = collections.Counter()
_COND = torch.ops.higher_order.cond


def counts():
    """How many conds were inlined (identical branches) and kept, since the process started."""
    return dict(_counts)


def inline_identical_conds(graph, resolve):
    """Replace each cond node of ``graph`` whose branches have one graph by that graph's ops.

    ``resolve(target)``: the GraphModule a ``get_attr`` node names. Branches are simplified
    first (a chain of conds over three kinds collapses from the inside). Returns how many
    conds were inlined."""
    inlined = 0
    for node in list(graph.find_nodes(op="call_function", target=_COND)):
        pred, true_attr, false_attr, operands = node.args[:4]
        if node.kwargs or not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in (true_attr, false_attr)):
            continue
        branches = [resolve(true_attr.target), resolve(false_attr.target)]
        for gm in branches:
            inner = inline_identical_conds(gm.graph, lambda t, gm=gm: _attr(gm, t, resolve))
            if inner:
                gm.recompile()
                inlined += inner
        keys = [graph_key(gm) for gm in branches]
        if (keys[0] is None or keys[1] is None or keys[0][0] != keys[1][0]
                or not all(u.op == "call_function" and u.target is operator.getitem for u in node.users)):
            _counts["kept"] += 1
            continue
        _inline(graph, node, branches[0].graph, list(operands))
        for attr in (true_attr, false_attr, pred):
            if not attr.users and attr.op != "placeholder":
                graph.erase_node(attr)
        _counts["inlined"] += 1
        inlined += 1
    if inlined:
        graph.lint()
    return inlined


def _attr(gm, target, resolve):
    """A branch's own attribute, else one the frame installed (Dynamo's nested subgraphs)."""
    try:
        return resolve_attr(gm, target)
    except AttributeError:
        return resolve(target)


def _inline(graph, node, branch, operands):
    """The branch's nodes copied before ``node``, its placeholders read as ``operands``; the
    cond's ``getitem`` users read the branch's outputs."""
    placeholders = branch.find_nodes(op="placeholder")
    env = dict(zip(placeholders, operands))
    with graph.inserting_before(node):
        for n in branch.nodes:
            if n.op in ("placeholder", "output"):
                continue
            env[n] = graph.node_copy(n, lambda a: env[a])
    (outs,) = branch.find_nodes(op="output")[0].args
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for user in list(node.users):  # all getitem (checked by the caller)
        user.replace_all_uses_with(_mapped(outs[user.args[1]], env))
        graph.erase_node(user)
    graph.erase_node(node)


def _mapped(value, env):
    return env[value] if isinstance(value, torch.fx.Node) else value
