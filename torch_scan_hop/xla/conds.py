"""A ``cond`` in a body lowered for XLA: both branches staged out, then a select per output.

``layers.alike`` runs a stack of several layer kinds as one scan whose step picks each layer's
code with ``torch.cond``. Dynamo's tracker replaces a cond whose branches traced alike by one
branch (``trace.same_branches``), but a body traced by make_fx (an XLA call under no_grad) keeps
it, and so does a body whose kinds really run different code. The XLA lowering stages a body out
once, on placeholder tensors (``xla.body``): a cond run there would read its predicate on the
host, which a placeholder cannot give (and inside a While there is no per-step value to read).

So each cond becomes its branches' ops and, per output, ``where(pred, true_out, false_out)``:
XLA computes both and keeps the one the predicate picks, the loop's value either way. Branches
with one graph are staged once, with no select (Gemma 3 under sdpa or eager attention pays
nothing). Gradients keep that property: autograd's backward of a cond is a cond of the two
branches' backward graphs, rewritten the same way, so the branch not taken has its gradient
dropped by the select, never multiplied by a zero that a NaN or inf of it would survive.
The price of branches that differ is both branches' work in every step.

A cond is rewritten whole (its outputs read through ``getitem``, as every traced cond's are)
or the body is refused with a ScanError: the While cannot run it otherwise. Counts:
``counts()["one_branch"]`` and ``counts()["selected"]``.
"""
import collections
import copy

import torch

from ..core.trees import ScanError
from ..trace.cache import resolve_attr
from ..trace.same_branches import copy_branch, outputs_read_one_by_one, same_graph

_COND = torch.ops.higher_order.cond
_WHERE = torch.ops.aten.where.self
_counts = collections.Counter()


def counts():
    """How many conds were staged as one branch and as a select, since the process started."""
    return dict(_counts)


def conds_as_selects(body):
    """``body`` with every cond (nested ones included) replaced by its branches' ops and a select
    per output: a new GraphModule, ``body`` unchanged; ``body`` itself when it has no cond.

    Raises:
        ScanError: a cond whose outputs are used other than one by one (``getitem``).
    """
    if not isinstance(body, torch.fx.GraphModule) or not body.graph.find_nodes(op="call_function", target=_COND):
        return body
    gm = torch.fx.GraphModule(body, copy.deepcopy(body.graph))
    for node in list(gm.graph.find_nodes(op="call_function", target=_COND)):
        _replace(gm, node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _replace(gm, node):
    pred, true_attr, false_attr, operands = node.args[:4]
    if node.kwargs or not outputs_read_one_by_one(node):
        raise ScanError("a torch.cond in a scan body on XLA has its outputs read whole, not one by one; "
                        "XLA runs a cond in a scan as both branches and a select per output")
    branches = [conds_as_selects(resolve_attr(gm, a.target)) for a in (true_attr, false_attr)]
    same = same_graph(*branches)
    if isinstance(pred, bool):
        branches, same = [branches[0 if pred else 1]], True
    outs = [_staged(gm, node, b, list(operands)) for b in branches[:1 if same else 2]]
    for user in list(node.users):
        i = user.args[1]
        if same:
            value = outs[0][i]
        else:
            with gm.graph.inserting_before(node):
                value = gm.graph.call_function(_WHERE, (pred, outs[0][i], outs[1][i]))
            value.meta = dict(user.meta)
        user.replace_all_uses_with(value)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    _counts["one_branch" if same else "selected"] += 1


def _staged(gm, node, branch, operands):
    """The branch's nodes copied before ``node`` (its placeholders read as ``operands``, its
    attributes installed on ``gm``); the values of its outputs."""
    def get_attr(n):
        attr = gm.graph.get_attr(_install(gm, resolve_attr(branch, n.target), n.target))
        attr.meta = dict(n.meta)
        return attr
    return copy_branch(gm.graph, node, branch.graph, operands, get_attr)


def _install(gm, value, name):
    """``value`` as an attribute of ``gm`` under a fresh name built from ``name``."""
    base, k = name.replace(".", "_"), 0
    while hasattr(gm, f"{base}_{k}"):
        k += 1
    attr = f"{base}_{k}"
    if isinstance(value, torch.nn.Module):
        gm.add_module(attr, value)
    else:
        setattr(gm, attr, value)
    return attr
