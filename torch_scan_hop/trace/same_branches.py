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
        if not same_graph(*branches) or not outputs_read_one_by_one(node):
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


def same_graph(a, b):
    """Whether the GraphModules ``a`` and ``b`` compute one graph (``graph_key``; False where
    either has no key)."""
    ka, kb = graph_key(a), graph_key(b)
    return ka is not None and kb is not None and ka[0] == kb[0]


def outputs_read_one_by_one(node):
    """Every user of the cond ``node`` reads one output (``getitem``), as a traced cond's do."""
    return all(u.op == "call_function" and u.target is operator.getitem for u in node.users)


def copy_branch(graph, node, branch, operands, get_attr=None):
    """The values of ``branch``'s outputs, its nodes copied into ``graph`` before ``node`` with
    its placeholders read as ``operands``. ``get_attr(n)``: the node of ``graph`` standing for
    the branch's ``get_attr`` node ``n`` (by default ``n`` copied as it is)."""
    env = dict(zip(branch.find_nodes(op="placeholder"), operands))
    with graph.inserting_before(node):
        for n in branch.nodes:
            if n.op in ("placeholder", "output"):
                continue
            env[n] = get_attr(n) if n.op == "get_attr" and get_attr is not None \
                else graph.node_copy(n, lambda a: env[a])
    (outs,) = branch.find_nodes(op="output")[0].args
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    return [env[o] if isinstance(o, torch.fx.Node) else o for o in outs]


def _inline(graph, node, branch, operands):
    """The branch's nodes copied before ``node``; the cond's ``getitem`` users read its outputs."""
    outs = copy_branch(graph, node, branch, operands)
    for user in list(node.users):  # all getitem (checked by the caller)
        user.replace_all_uses_with(outs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
