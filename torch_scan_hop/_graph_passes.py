"""Peephole clean-up of the partitioned step graphs.

The backward graph runs once per step, so every op in it is paid T times; in
eager each op is also one Python-level dispatch. AOTAutograd's joint leaves
no-op ``detach`` chains and ``t(t(x))`` pairs behind, and accumulating a
weight gradient as ``add(sum, mm(a, b))`` allocates an intermediate that
``addmm`` does not. These rewrites keep values bit-for-bit equal up to the
rounding of a fused multiply-add.
"""
import torch

aten = torch.ops.aten


def _is(node, target):
    return node.op == "call_function" and node.target is target


def _drop_detach(graph):
    """detach (and alias) is the identity on values; a backward graph never builds autograd state."""
    for node in list(graph.nodes):
        if _is(node, aten.detach.default) or _is(node, aten.alias.default):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def drop_aliases(gm):
    """A joint's ``alias`` nodes (newer torch records a saved output as one)
    would be saved as values of their own: fold them before partitioning."""
    graph = gm.graph
    for node in list(graph.nodes):
        if _is(node, aten.alias.default):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    gm.recompile()
    return gm


def _fold_double_transpose(graph):
    for node in list(graph.nodes):
        if _is(node, aten.t.default) and isinstance(node.args[0], torch.fx.Node) \
                and _is(node.args[0], aten.t.default):
            node.replace_all_uses_with(node.args[0].args[0])
            graph.erase_node(node)


def fuse_accumulate(graph, add_node):
    """``add(acc, mm(a, b))`` -> ``addmm(acc, a, b)`` when the mm has no other use."""
    acc, term = add_node.args[:2]
    if not (isinstance(term, torch.fx.Node) and _is(term, aten.mm.default) and len(term.users) == 1):
        return add_node
    with graph.inserting_before(add_node):
        fused = graph.call_function(aten.addmm.default, (acc, *term.args))
    fused.meta = dict(add_node.meta)
    add_node.replace_all_uses_with(fused)
    graph.erase_node(add_node)
    graph.erase_node(term)
    return fused


def _views_to_reshapes(graph):
    """Per-step inputs of a step graph are slices of stacked tensors, which are
    contiguous even where the traced value was not (a saved transpose, say):
    a ``view`` that relied on the traced strides would fail, ``reshape`` adapts."""
    for node in graph.nodes:
        if _is(node, aten.view.default) or _is(node, aten._unsafe_view.default):
            node.target = aten.reshape.default


def simplify(gm, keep_detach=False):
    """Apply the rewrites in place; return gm.

    A forward graph keeps its ``detach`` nodes: it becomes the body of a scan
    node in a traced graph (make_fx), and replaying that graph with inputs
    that require grad differentiates the body graph itself, where a dropped
    ``v.detach()`` would let gradient flow as the loop never does.
    """
    if not keep_detach:
        _drop_detach(gm.graph)
    _views_to_reshapes(gm.graph)
    _fold_double_transpose(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
