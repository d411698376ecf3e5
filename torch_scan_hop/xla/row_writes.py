"""A carried buffer the body writes rows of per step (``buf[t] = h``), written by the While.

Traced, ``buf[t] = h`` is an ``index_put`` of the carry at a 0-d index (``trace/indexing.py``).
torch_xla lowers it to a scatter, which XLA turns into a dynamic-update-slice of the whole
carry, fused with the row's producer and a bounds check reading the old row: XLA CPU's loop
fusion emitter then writes every element of the ``(T, H)`` buffer, O(T) per step and O(T^2)
per scan (issue 63; the stacked ys had the same cost, see csrc/hlo_scan.cc). Here such a body
returns the carry input unchanged and, after its ys, the row (the carry's shape with the
written dim of size 1) and its index (negative ones wrapped, as indexing does); the While
(csrc/hlo_scan.cc, "written rows") writes it as a lone, in-place update before the next
step's body reads the buffer.

Rows of any dim: the row of ``buf[:, t] = h`` has a unit dim in the middle, which XLA's layout
assignment moved in the pending row of the loop state (another layout than the buffer's, the same
bytes), and the copy back was fused into the update, which then wrote the whole buffer again; so
the While holds such a buffer with its written dim first (csrc/hlo_rows.h, one transpose each way
per scan), where a row is a slice of the first dim as for ``buf[t] = h``.

A carry qualifies when its output is such an ``index_put`` of its own input (one 0-d integer
index; or ``index_put_`` of a clone of it, as a body traced without functionalization has it)
that nothing else in the body reads; other reads of the input see the buffer as the step began,
which the While also gives them. Also a chain of up to four such writes of one dim, each
``index_put`` of the one before (``_row_ops``), where a write may accumulate: ``index_put(...,
accumulate=True)``, or the ``add`` of one into zeros of the buffer's shape, which is what the
backward of a body reading its buffer has (``g[t] = 0`` for the write, ``g[t - 1] += dr`` for the
read ``buf[t - 1]``: the whole-buffer add kept the backward O(T) per step). Such an added row is
written whole: the step's input row (or what an earlier write of the step at the same index gave
it) plus the addend, each of the step's rows a pending row of the While, written in order.
Anything else keeps torch_xla's scatter (right, slower). An index outside the buffer, an
IndexError in the loop, is clamped by the update instead (XLA cannot raise).
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
_ADD = torch.ops.aten.add.Tensor
_ZEROS = (torch.ops.aten.zeros.default, torch.ops.aten.new_zeros.default)


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
    gm = _compat.tracing.lazy_graph_module(body, copy.deepcopy(body.graph))
    found = _row_writes(gm, num_carry, inputs)
    if not found:
        return RowWrites(body, [])
    placeholders = gm.graph.find_nodes(op="placeholder")
    output = gm.graph.output_node()
    outputs = list(output.args[0])
    extra, writes, written = [], [], []
    for k, ops in found:
        with gm.graph.inserting_before(output):
            for index, value, dim in _row_values(gm.graph, placeholders[k], ops, inputs[k][0]):
                extra += [value, index]
                writes.append((k, dim))
        written.append(outputs[k])
        outputs[k] = placeholders[k]
    output.args = (outputs + extra,)
    for write in written:  # index_put_ is not dead code to FX: its mutation could be seen
        if write.target is not _INDEX_PUT_:
            continue
        buf = write.args[0]
        gm.graph.erase_node(write)
        if buf is not None and buf.op == "call_function":  # a clone read (before the write): the carry itself
            buf.replace_all_uses_with(buf.args[0])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return RowWrites(_RowsAfterYs(gm, writes), writes)


def _row_writes(body, num_carry, inputs):
    """``[(carry index, [(op, index, value, dim), ...])]``: the carries whose output is rows written into
    their input, each with those writes in order (``_row_ops``)."""
    placeholders = body.graph.find_nodes(op="placeholder")
    outputs = list(body.graph.output_node().args[0])
    meta = dict(zip(placeholders, inputs))
    found = []
    for k in range(min(num_carry, len(placeholders), len(outputs))):
        dim = _written_dim(outputs[k], placeholders[k], outputs, meta)
        if dim is not None:
            node = outputs[k]
            found.append((k, [("set", node.args[1][-1], node.args[2], dim)]))
            continue
        node = outputs[k]
        if not isinstance(node, torch.fx.Node) or len(node.users) != 1 or sum(o is node for o in outputs) != 1:
            continue
        ops = _row_ops(node, placeholders[k], meta)
        if ops and len(ops) <= _MOST_ROWS and len({dim for *_, dim in ops}) == 1:
            found.append((k, ops))
    return found


_MOST_ROWS = 4  # rows one carry may have written per step (each is a pending row of the While's state)


def _row_ops(node, carry, meta):
    """The row writes ``node`` makes into ``carry`` in order, ``[(op, index, value, dim)]`` (``op``: "set"
    for ``index_put``, "add" for one accumulating, or for ``add`` of an accumulating ``index_put`` into
    zeros of the carry's shape: the backward of a read ``buf[s]``); None for anything else. Each
    node of the chain but ``node`` has no other user (its value is not seen elsewhere)."""
    if node is carry:
        return []
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    row = _accumulated_row(node, meta)
    if node.target is _INDEX_PUT and row is None:
        buf, indices, value = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if not isinstance(value, torch.fx.Node) or not _is_index_list(indices, meta) or _lone(buf, carry) is None:
            return None
        ops = _row_ops(buf, carry, meta)
        return None if ops is None else ops + [("add" if accumulate else "set", indices[-1], value, len(indices) - 1)]
    if node.target is _ADD and len(node.args) == 2 and not node.kwargs:
        for base, other in (node.args, node.args[::-1]):
            row = _accumulated_row(other, meta)
            if row is not None and _lone(other, None) is not None and _lone(base, carry) is not None \
                    and _same_shape(row[3], carry, meta):
                ops = _row_ops(base, carry, meta)
                return None if ops is None else ops + [("add", *row[:3])]
    return None


def _lone(node, carry):
    """``node`` when it is ``carry`` or has one user, else None."""
    return node if node is carry or (isinstance(node, torch.fx.Node) and len(node.users) == 1) else None


def _accumulated_row(node, meta):
    """``(index, value, dim, zeros)`` for ``index_put(zeros, [.., i], v, accumulate=True)`` whose zeros have
    no other use, else None."""
    if not isinstance(node, torch.fx.Node) or node.target is not _INDEX_PUT or len(node.args) < 4 or not node.args[3]:
        return None
    zeros, indices, value = node.args[:3]
    if not isinstance(zeros, torch.fx.Node) or zeros.target not in _ZEROS or len(zeros.users) != 1 \
            or not isinstance(value, torch.fx.Node) or not _is_index_list(indices, meta):
        return None
    return indices[-1], value, len(indices) - 1, zeros


def _same_shape(zeros, carry, meta):
    size = zeros.args[1] if zeros.target is torch.ops.aten.new_zeros.default else zeros.args[0]
    shape = meta.get(carry, (None,))[0]
    return shape is not None and isinstance(size, (list, tuple)) and list(size) == list(shape)


def _row_values(graph, carry, ops, shape):
    """``[(index, value, dim)]`` of ``ops``' rows in order, each the row's whole value once written
    (an added row: the step's input row, or the value an earlier write of the step gave it, plus the
    addend), new nodes of ``graph`` where needed."""
    call = graph.call_function
    done, rows = [], []
    for op, index, value, dim in ops:
        at = call(torch.ops.aten.remainder.Scalar, (index, shape[dim]))  # (a negative index counts from the end)
        if op == "add":
            current = call(torch.ops.aten.index.Tensor, (carry, [None] * dim + [index]))
            for earlier, row in done:
                current = call(torch.ops.aten.where.self, (call(torch.ops.aten.eq.Tensor, (at, earlier)), row, current))
            value = call(_ADD, (current, value))
        done.append((at, value))
        rows.append((index, value, dim))
    return rows


def _written_dim(node, carry, outputs, meta):
    """The dim ``node`` (a carry's output) writes one row of in ``carry`` (``index_put``'s one index, at
    the dim its list's length says), else None."""
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
    if not isinstance(value, torch.fx.Node) or not _is_index_list(indices, meta):
        return None
    return len(indices) - 1


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
