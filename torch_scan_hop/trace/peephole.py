"""Peephole clean-up of the partitioned step graphs.

The backward graph runs once per step, so every op in it is paid T times; in
eager each op is also one Python-level dispatch. AOTAutograd's joint leaves
no-op ``detach`` chains and ``t(t(x))`` pairs behind, and accumulating a
weight gradient as ``add(sum, mm(a, b))`` allocates an intermediate that
``addmm`` does not. These rewrites keep values bit-for-bit equal up to the
rounding of a fused multiply-add.
"""
import torch

from .. import _compat
from ..core.aten_nodes import VALUE_IDENTITIES

aten = torch.ops.aten


def _is(node, target):
    return node.op == "call_function" and node.target is target


def _drop_detach(graph):
    """detach (and alias) is the identity on values; a backward graph never builds autograd state."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in VALUE_IDENTITIES:
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


def views_to_reshapes(graph):
    """Per-step inputs of a step graph are slices of stacked tensors, which are
    contiguous even where the traced value was not (a saved transpose, say):
    a ``view`` that relied on the traced strides would fail, ``reshape`` adapts.
    Also applied to a body re-traced into an outer graph (``op.proxy``): there too
    a runtime value's strides may differ from its trace's (Qwen3-Next's gated delta
    rule's backward had a view of a gradient that came out laid out otherwise)."""
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
    views_to_reshapes(gm.graph)
    _fold_double_transpose(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _dense_order(val):
    """The permutation making ``val`` contiguous when it is a dense, non-contiguous
    permutation of memory (an attention output in ``(b, h, t, d)`` seen over
    ``(b, t, h, d)`` memory), else None. Static shapes only."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    size, stride = val.shape, val.stride()
    # ints first: asking a symbolic value whether it is contiguous would add a guard
    if not all(isinstance(v, int) for v in (*size, *stride)) or val.numel() == 0 or val.is_contiguous():
        return None
    perm = sorted(range(val.dim()), key=lambda d: (-stride[d], d))
    return perm if val.permute(perm).is_contiguous() else None


def save_dense_layouts(fwd, bwd, num_outputs):
    """A scan stacks each saved value into a contiguous ``(L, ...)`` buffer and hands the
    backward contiguous rows. A value saved in a permuted layout was therefore copied with
    a transpose every forward step, and often copied back (``reshape`` of a row that is no
    longer a view) every backward step. Save ``value.permute(p)``, contiguous, instead: the
    forward's copy is a plain one and the backward's ``permute`` back restores the traced
    strides as a view. Expects ``_align_saves``' order (saved i is backward input i)."""
    with _compat.disable_proxy_modes_tracing():  # metadata of fake values, not ops of an outer trace
        return _save_dense_layouts(fwd, bwd, num_outputs)


def _save_dense_layouts(fwd, bwd, num_outputs):
    fwd_out = fwd.graph.find_nodes(op="output")[0]
    (outs,) = fwd_out.args
    outs = list(outs)
    placeholders = list(bwd.graph.find_nodes(op="placeholder"))
    changed = False
    for i, ph in zip(range(num_outputs, len(outs)), placeholders):
        node = outs[i]
        perm = None if node.op == "placeholder" else _dense_order(node.meta.get("val"))
        if perm is None:
            continue
        val = node.meta["val"]
        with fwd.graph.inserting_before(fwd_out):
            saved = fwd.graph.call_function(aten.permute.default, (node, perm))
        saved.meta["val"] = val.permute(perm)
        outs[i] = saved
        inverse = sorted(range(len(perm)), key=perm.__getitem__)
        with bwd.graph.inserting_after(placeholders[-1]):
            back = bwd.graph.call_function(aten.permute.default, (ph, inverse))
        ph.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        back.meta["val"], ph.meta["val"] = val, saved.meta["val"]
        changed = True
    if changed:
        fwd_out.args = (tuple(outs),)
        for gm in (fwd, bwd):
            gm.recompile()
    return fwd, bwd


_EXTREMA = (aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)


def _is_extremum(node):
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _EXTREMA \
        and bool(node.args)


def recompute_saved_extrema(fwd, bwd, num_outputs):
    """A saved max / min (``amax``, ``amin``, full ``max`` / ``min``) whose input is saved too is
    recomputed in the backward from that saved input. Their gradient finds the input's maxima
    by exact equality with the result (``eq(self, result)``, then a count). Inside XLA's While
    the two saved values could come from separately fused copies of the same expression, one
    rounded differently: at the last step of an unrolled scan the saved amax was 1 ulp off every
    element of its saved input, the count 0, and the step's gradient lost. Recomputed from the
    saved input, the result is one of its elements. Expects ``saved i is backward input i``."""
    fwd_out = fwd.graph.find_nodes(op="output")[0]
    (outs,) = fwd_out.args
    saved = list(outs[num_outputs:])
    inputs = list(bwd.graph.find_nodes(op="placeholder"))[:len(saved)]
    placeholder_of = dict(zip(saved, inputs))
    drop = [i for i, node in enumerate(saved) if _is_extremum(node) and node.args[0] in placeholder_of
            and not _is_extremum(node.args[0])]  # (whose own placeholder stays)
    if not drop:
        return fwd, bwd
    last = list(bwd.graph.find_nodes(op="placeholder"))[-1]  # the new nodes after every input
    for i in drop:
        node, ph = saved[i], inputs[i]
        with bwd.graph.inserting_after(last):
            again = bwd.graph.call_function(node.target, (placeholder_of[node.args[0]], *node.args[1:]),
                                            dict(node.kwargs))
        again.meta = dict(ph.meta)
        ph.replace_all_uses_with(again)
        bwd.graph.erase_node(ph)
        last = again
    fwd_out.args = (tuple(outs[:num_outputs]) + tuple(n for i, n in enumerate(saved) if i not in drop),)
    for gm in (fwd, bwd):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return fwd, bwd
