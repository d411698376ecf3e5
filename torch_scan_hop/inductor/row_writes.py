"""A carried buffer the body writes rows of, written in place by the loop (``buf[t] = h``).

Traced, ``buf[t] = h`` (``with_index=True``'s step index ``t``) is an out-of-place
``index_put`` of the carry ``buf`` (``trace/indexing.py``): inductor then gives the new
carry a buffer of its own and copies the whole ``(T, H)`` buffer into it in every step
before writing the row, O(T) per step and O(T^2) per scan, where the Python loop writes
one row. The old value of the carry is dead once the step has made the new one, so the
write may go into the carried buffer itself: ``index_put_`` of the body's own input,
moved after every other read of it. The loop's init is cloned once per call instead
(the caller's tensor is not the loop's to write).

A carry qualifies when the body returns, at its own position and nowhere else, an
``index_put`` of its input (or a chain of them, each read only by the next), and every other
use of that input is a read that makes a new tensor (no view, which the write would change
under it, and no output). The backward of a body that also reads a row (``buf[t - 1]``) adds
that read's gradient as a whole zero buffer scattered into: folded first into one more
accumulating ``index_put`` of the chain. Any other carry keeps the copy (right, slower).
``counts()`` says how often each happened.
"""
import collections
import copy

import torch

from ..core.aten_nodes import makes_new_tensor

aten = torch.ops.aten
_COUNTS = collections.Counter()


def counts():
    """``{"in_place": n, "kept": m}``: carries written in place, and index_put carries left as copies."""
    return dict(_COUNTS)


def write_in_place(body, num_carry):
    """``(loop body, positions)``: ``body`` (a scan body's GraphModule) with its qualifying row
    writes made in-place writes of their carry input, and the frozenset of those carries' positions
    (their inits must be cloned). A copy when anything changes: the scan node's own body stays
    functional, should another scan node share it."""
    if not any(_is_index_put(o) or _scattered_add(o) for o in _carry_outputs(body, num_carry)):
        return body, frozenset()
    gm = torch.fx.GraphModule(body, copy.deepcopy(body.graph))
    _fold_scattered_adds(gm, num_carry)
    placeholders = gm.graph.find_nodes(op="placeholder")
    output = gm.graph.output_node()
    outputs = list(output.args[0])
    done = []
    for k, node in enumerate(_carry_outputs(gm, num_carry)):
        chain = _writes(node, placeholders[k]) if _is_index_put(node) else None
        if chain is None or _refusal(chain, placeholders[k], outputs):
            _COUNTS["kept"] += _is_index_put(node)
            continue
        for write in chain:  # after every other read of the input (graph order is run order)
            output.prepend(write)
            write.target = aten.index_put_.default
        done.append(k)
        _COUNTS["in_place"] += 1
    if not done:
        return body, frozenset()
    gm.graph.lint()
    gm.recompile()
    return gm, frozenset(done)


def _carry_outputs(body, num_carry):
    placeholders = body.graph.find_nodes(op="placeholder")
    outputs = list(body.graph.output_node().args[0])
    return outputs[:min(num_carry, len(placeholders), len(outputs))]


def _is_index_put(node):
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.index_put.default


def _writes(node, carry):
    """The ``index_put`` nodes from the first one of ``carry`` up to ``node``, each the only
    use of the one before (``buf[t] = a`` then ``buf[s] += b``), or None."""
    chain = [node]
    while chain[-1].args[0] is not carry:
        inner = chain[-1].args[0]
        if not _is_index_put(inner) or len(inner.users) != 1:
            return None
        chain.append(inner)
    return chain[::-1]


def _refusal(chain, carry, outputs):
    """Why writing ``chain`` into ``carry`` in place could change a value the body computes, or None."""
    node = chain[-1]
    if sum(o is node for o in outputs) != 1 or len(node.users) != 1:
        return "the written buffer is also read or returned elsewhere"
    if carry in outputs:
        return "the carry input is returned as well"
    if not _same_meta(node, carry):
        return "the written buffer's layout differs from its input's"
    for user in carry.users:
        if user is not chain[0] and not makes_new_tensor(user):
            return f"the carry input is also used by {user.format_node()}, which may alias it"
    return None


def _fold_scattered_adds(gm, num_carry):
    """Each carry output ``add(a, index_put_(zeros, indices, v, accumulate=True))`` (the gradient of
    a read ``buf[t - 1]`` added to the buffer's gradient: a whole zero buffer and a whole add per
    step) becomes ``index_put(a, indices, v, accumulate=True)``, the same values, which
    ``write_in_place`` can then write in place. Only for 0-d indices: one element each, so the sums
    are the same sums."""
    output = gm.graph.output_node()
    for k in range(len(_carry_outputs(gm, num_carry))):
        while (parts := _scattered_add(output.args[0][k])) is not None:
            node, (a, scatter) = output.args[0][k], parts
            with gm.graph.inserting_before(node):
                folded = gm.graph.call_function(aten.index_put.default, (a, scatter.args[1], scatter.args[2], True))
            folded.meta.update(node.meta)
            node.replace_all_uses_with(folded)
            zeros = scatter.args[0]
            for dead in (node, scatter, zeros):
                gm.graph.erase_node(dead)


def _scattered_add(node):
    """``(a, scatter)`` where ``node`` is ``a + scatter`` (either order) and ``scatter`` an
    accumulating ``index_put_`` at 0-d indices into a zero ``full`` used nowhere else; else None."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    for a, scatter in (node.args, node.args[::-1]):
        if not (isinstance(scatter, torch.fx.Node) and scatter.target is aten.index_put_.default
                and len(scatter.users) == 1 and isinstance(a, torch.fx.Node)):
            continue
        zeros, indices = scatter.args[0], scatter.args[1]
        accumulate = scatter.args[3] if len(scatter.args) > 3 else scatter.kwargs.get("accumulate", False)
        if accumulate is True and isinstance(zeros, torch.fx.Node) and zeros.target is aten.full.default \
                and zeros.args[1] == 0 and len(zeros.users) == 1 and _scalar_indices(indices) \
                and _same_meta(node, a) and _same_meta(node, zeros):
            return a, scatter
    return None


def _scalar_indices(indices):
    vals = [getattr(e, "meta", {}).get("val") for e in indices if e is not None]
    return bool(vals) and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in vals)


def _same_meta(node, carry):
    new, old = node.meta.get("val"), carry.meta.get("val")
    if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
        return False
    return new.dtype == old.dtype and new.device == old.device and new.shape == old.shape \
        and new.stride() == old.stride()
