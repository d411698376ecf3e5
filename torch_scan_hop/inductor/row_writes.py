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
``index_put`` of its input, and every other use of that input is a read that makes a
new tensor (no view, which the write would change under it, and no output). Any other
carry keeps the copy (right, slower). ``counts()`` says how often each happened.
"""
import collections
import copy

import torch

from .. import _compat

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
    placeholders = body.graph.find_nodes(op="placeholder")
    outputs = list(body.graph.output_node().args[0])
    done = []
    for k in range(min(num_carry, len(placeholders), len(outputs))):
        if not _is_index_put(outputs[k]):
            continue
        if _refusal(outputs[k], placeholders[k], outputs):
            _COUNTS["kept"] += 1
            continue
        done.append(k)
        _COUNTS["in_place"] += 1
    if not done:
        return body, frozenset()
    gm = torch.fx.GraphModule(body, copy.deepcopy(body.graph))
    output = gm.graph.output_node()
    for k in done:
        node = output.args[0][k]
        output.prepend(node)  # after every other read of the input (graph order is run order)
        node.target = aten.index_put_.default
    gm.graph.lint()
    gm.recompile()
    return gm, frozenset(done)


def _is_index_put(node):
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.index_put.default


def _refusal(node, carry, outputs):
    """Why writing ``node`` into ``carry`` in place could change a value the body computes, or None."""
    if node.args[0] is not carry:
        return "writes another tensor than its carry input"
    if sum(o is node for o in outputs) != 1 or len(node.users) != 1:
        return "the written buffer is also read or returned elsewhere"
    if carry in outputs:
        return "the carry input is returned as well"
    if not _same_meta(node, carry):
        return "the written buffer's layout differs from its input's"
    for user in carry.users:
        if user is not node and not _makes_new_tensor(user):
            return f"the carry input is also used by {user.format_node()}, which may alias it"
    return None


def _same_meta(node, carry):
    new, old = node.meta.get("val"), carry.meta.get("val")
    if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
        return False
    return new.dtype == old.dtype and new.device == old.device and new.shape == old.shape \
        and new.stride() == old.stride()


def _makes_new_tensor(user):
    """A call of an ATen op that neither views nor mutates its inputs (its result is its own)."""
    target = user.target
    if user.op != "call_function" or not _compat.is_op_overload(target):
        return False
    schema = _compat.op_schema(target)
    return not target.is_view and not schema.is_mutable \
        and not any(r.alias_info is not None for r in schema.returns)
