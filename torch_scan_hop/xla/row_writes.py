"""A carried buffer the body writes one row of per step (``buf[t] = h``), written by the While.

Traced, ``buf[t] = h`` is an ``index_put`` of the carry at a 0-d index (``trace/indexing.py``).
torch_xla lowers it to a scatter, which XLA turns into a dynamic-update-slice of the whole
carry, fused with the row's producer and a bounds check reading the old row: XLA CPU's loop
fusion emitter then writes every element of the ``(T, H)`` buffer, O(T) per step and O(T^2)
per scan (issue 63; the stacked ys had the same cost, see csrc/hlo_scan.cc). Here such a body
returns the carry input unchanged and, after its ys, the row (the carry's shape with the
written dim of size 1) and its index (negative ones wrapped, as indexing does); the While
(csrc/hlo_scan.cc, "written rows") writes it as a lone, in-place update before the next
step's body reads the buffer.

Only rows of the first dim (``buf[t] = h``): the row of ``buf[:, t] = h`` has a unit dim in the
middle, XLA's layout assignment gives the pending row in the loop state another layout than the
buffer's (the unit dim moved first, the same bytes), and the copy between the two layouts is
fused into the update, which then writes the whole buffer again. Such writes keep torch_xla's
scatter; on the first dim the row's layout is the buffer's.

A carry qualifies when its output is such an ``index_put`` of its own input (no accumulate,
one 0-d integer index; or ``index_put_`` of a clone of it, as a body traced
without functionalization has it) that nothing else in the body reads; other reads of
the input see the buffer as the step began, which the While also gives them. Anything else
keeps torch_xla's scatter (right, slower). An index outside the buffer, an IndexError in the
loop, is clamped by the update instead (XLA cannot raise).
"""
import copy
import dataclasses
from typing import List, Tuple

import torch

from .. import _compat
from ..core.aten_nodes import makes_new_tensor

_INDEX_PUT = torch.ops.aten.index_put.default
_INDEX_PUT_ = torch.ops.aten.index_put_.default
_CLONE = torch.ops.aten.clone.default


@dataclasses.dataclass
class RowWrites:
    """The body with its row writes deferred, and ``(carry index, written dim)`` of each."""

    body: object
    writes: List[Tuple[int, int]]


def defer_row_writes(body, num_carry, inputs):
    """``RowWrites`` for an aten graph ``body`` (a copy when anything qualifies; ``body`` itself is
    not changed); a body that is not a graph, or has no such write, comes back as it is.
    ``inputs``: ``(shape, dtype)`` of each body input, for graphs whose nodes carry no example
    values (a backward step made by our own tracing)."""
    if not isinstance(body, torch.fx.GraphModule):
        return RowWrites(body, [])
    found = _row_writes(body, num_carry, inputs)
    if not found:
        return RowWrites(body, [])
    gm = torch.fx.GraphModule(body, copy.deepcopy(body.graph))
    placeholders = gm.graph.find_nodes(op="placeholder")
    output = gm.graph.output_node()
    outputs = list(output.args[0])
    extra = []
    for k, _dim in found:
        extra += [outputs[k].args[2], outputs[k].args[1][-1]]
    writes = [outputs[k] for k, _ in found]
    for k, _dim in found:
        outputs[k] = placeholders[k]
    output.args = (outputs + extra,)
    for write in writes:  # index_put_ is not dead code to FX: its mutation could be seen
        buf = write.args[0]
        gm.graph.erase_node(write)
        if buf is not None and buf.op == "call_function":  # a clone read (before the write): the carry itself
            buf.replace_all_uses_with(buf.args[0])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return RowWrites(_RowsAfterYs(gm, found), found)


def _row_writes(body, num_carry, inputs):
    placeholders = body.graph.find_nodes(op="placeholder")
    outputs = list(body.graph.output_node().args[0])
    meta = dict(zip(placeholders, inputs))
    found = []
    for k in range(min(num_carry, len(placeholders), len(outputs))):
        dim = _written_dim(outputs[k], placeholders[k], outputs, meta)
        if dim is not None:
            found.append((k, dim))
    return found


def _written_dim(node, carry, outputs, meta):
    """The dim ``node`` (a carry's output) writes one row of in ``carry``, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in (_INDEX_PUT, _INDEX_PUT_):
        return None
    buf, indices, value = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if isinstance(buf, torch.fx.Node) and buf.target is _CLONE:  # of a clone of the carry
        if node.target is _INDEX_PUT_ and not _read_before(buf, node):
            return None
        buf = buf.args[0]
    elif node.target is _INDEX_PUT_:
        return None
    if buf is not carry or accumulate or len(node.users) != 1 or sum(o is node for o in outputs) != 1:
        return None
    if not isinstance(value, torch.fx.Node) or not _is_index_list(indices, meta) or len(indices) != 1:
        return None  # a row of another dim than the first: see the module's docstring
    return 0


def _read_before(clone, write):
    """Whether every other use of ``clone`` (through views) comes before ``write`` in graph order
    (the order the body runs in) and makes a new tensor: such a read sees the carry input."""
    for user in clone.users:
        if user is write:
            continue
        if _is_view(user):
            if not _read_before(user, write):
                return False
        elif not makes_new_tensor(user) or not _precedes(user, write):
            return False
    return True


def _is_view(node):
    return node.op == "call_function" and _compat.is_op_overload(node.target) and node.target.is_view


def _precedes(a, b):
    node = a.next
    while node.op != "root":
        if node is b:
            return True
        node = node.next
    return False


def _is_index_list(indices, meta):
    """``[None, ..., None, t]`` with ``t`` a 0-d integer tensor: one row at dim ``len - 1``."""
    if not isinstance(indices, (list, tuple)) or not indices or any(e is not None for e in indices[:-1]):
        return False
    index = indices[-1]
    val = getattr(index, "meta", {}).get("val")
    shape, dtype = (val.shape, val.dtype) if isinstance(val, torch.Tensor) else meta.get(index, (None, None))
    return shape is not None and len(shape) == 0 and not dtype.is_floating_point and not dtype.is_complex \
        and dtype is not torch.bool


class _RowsAfterYs:
    """Runs the rewritten graph and puts each write's value and index in the form the While
    writes: the row with the written dim of size 1 in the carry's dtype, the index as int64 in
    ``[0, size)`` for a valid one (a negative one counts from the end, as indexing does)."""

    def __init__(self, gm, writes):
        self.gm, self.writes = gm, writes

    def __call__(self, *args):
        outs = list(self.gm(*args))
        base = len(outs) - 2 * len(self.writes)
        rows = []
        for n, (k, dim) in enumerate(self.writes):
            value, index = outs[base + 2 * n], outs[base + 2 * n + 1]
            buf = args[k]
            shape = [*buf.shape[:dim], *buf.shape[dim + 1:]]  # what buf[..., t, ...] is
            row = value.to(buf.dtype).expand(shape).unsqueeze(dim)
            index = index.to(torch.int64)
            rows += [row, torch.where(index < 0, index + buf.shape[dim], index)]
        return outs[:base] + rows
