"""A pointwise scan body, translated statement by statement into Triton text, one lane per element of E.

Why a module of its own: the question "is every value of this body a function of ONE element of
the carry?" is answered here, node by node, and the answer is what makes one kernel with the time
loop inside right. E (the element space) is the carries' and ys' common shape; each value keeps a
map from its dims to E's dims (None: constant along that dim). A leaf (x row, closed-over tensor) is
broadcast onto E right-aligned, as the body's own broadcasting does, or, when it is not broadcastable
(Mamba's ``C_t[:, None, :]``), placed by the size-1 views it is used through, which all must agree
(``leaf_maps``: the kernel loads each leaf by these maps); a view may only insert, remove or expand
size-1 dims; anything else refuses the whole body (``Refused``).

One non-pointwise shape is accepted, because every training step has it: the backward of a body
that reads a closed-over tensor smaller than E accumulates that tensor's gradient in a carry of its
shape, ``g = g + sum(v, dims)`` (times factors constant along the summed dims, such as ``exp(w)``).
A sum over steps and over E dims can be taken in either order, so the kernel keeps a per-lane
partial of ``v`` over all steps and the operator sums the partials over those dims once at the end
(``Accumulated``). The carry must be read nowhere else in the body.
"""
import dataclasses

import torch

from .triton_ops import (CASTS, CONSTANTS, COPIES, EXPANDS, SIZE_ONE_VIEWS, Refused, cast_target, compute_type,
                         constant_value, expression, literal, round_to)

aten = torch.ops.aten
_SUMS = {aten.sum.dim_IntList, aten.sum.default}
_LINEAR = {aten.mul.Tensor, aten.div.Tensor, aten.neg.default}  # what a partial sum may go through
_SUMMABLE = {aten.add.Tensor, aten.sub.Tensor}  # two partial sums over the same dims


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A tensor the kernel reads or writes: its shape (an x's or y's row shape, without the step dim)
    and dtype."""

    shape: tuple
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Accumulated:
    """A carry ``g + sum(v)``: ``text`` is the lane's step contribution; the operator sums the partials
    over E dims ``summed`` and takes index 0 along ``first`` (dims whose lanes hold copies)."""

    text: str
    summed: tuple
    first: tuple


def leaf_dim_map(shape, element_shape) -> tuple:
    """A leaf's dims broadcast right-aligned onto E: the E dim of each of its dims (None for size 1)."""
    offset = len(element_shape) - len(shape)
    out = []
    for d, size in enumerate(shape):
        if size == 1:
            out.append(None)
        elif offset + d < 0 or element_shape[offset + d] != size:
            raise Refused(f"a leaf of shape {tuple(shape)} not broadcastable to {tuple(element_shape)}")
        else:
            out.append(offset + d)
    return tuple(out)


def _broadcast_map(out_shape, operands):
    """The dim map of an elementwise result of shape ``out_shape`` from ``(shape, map)`` operands."""
    result = []
    for k in range(len(out_shape)):
        seen = set()
        for shape, dims in operands:
            j = k - (len(out_shape) - len(shape))
            if j >= 0 and shape[j] != 1 and dims[j] is not None:
                seen.add(dims[j])
        if len(seen) > 1:
            raise Refused("operands whose dims come from different dims of the carry")
        result.append(seen.pop() if seen else None)
    return tuple(result)


def _view_map(in_shape, in_map, out_shape):
    """A view that only inserts or removes size-1 dims keeps the other dims' maps, in order."""
    kept = [(s, m) for s, m in zip(in_shape, in_map) if s != 1]
    if [s for s, _ in kept] != [s for s in out_shape if s != 1]:
        raise Refused(f"a view {tuple(in_shape)} -> {tuple(out_shape)} that moves data")
    it = iter(kept)
    return tuple(None if s == 1 else next(it)[1] for s in out_shape)


class Body:
    """``lines``: the step's statements; ``output(k, leaf)``: the text of output k (or ``Accumulated``).
    ``leaves``: the body's inputs in order (carries, x rows, closed-over tensors), ``names`` theirs."""

    def __init__(self, body: torch.fx.GraphModule, element_shape: tuple, leaves: list, names: list, carries: int):
        self.element, self.lines, self.value, self.maps, self.dtypes, self.shapes = element_shape, [], {}, {}, {}, {}
        self.partial = {}  # node -> E dims its lanes' values are still to be summed over
        self.accumulates = {}  # add node -> (the carry placeholder it adds to, the partial node)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(leaves):
            raise Refused(f"the body takes {len(placeholders)} inputs, the scan passes {len(leaves)}")
        self.placeholders = placeholders
        for k, (node, leaf, name) in enumerate(zip(placeholders, leaves, names)):
            self.value[node], self.dtypes[node], self.shapes[node] = name, leaf.dtype, tuple(leaf.shape)
            self.maps[node] = self._leaf_map(node, tuple(leaf.shape), is_carry=k < carries)
        self.leaf_maps = [self.maps[node] for node in placeholders]  # how the kernel loads each leaf
        self.outputs = None
        for node in body.graph.nodes:
            if node.op == "call_function":
                self._translate(node)
            elif node.op == "output":
                self.outputs = list(node.args[0])
            elif node.op != "placeholder":
                raise Refused(f"a {node.op} node in the body")

    def _leaf_map(self, node, shape, is_carry):
        """A leaf's dim map: right-aligned onto E, else (an x row or closed-over tensor only) the one
        its size-1 views give, when every use is such a view whose result is right-aligned onto E and
        all agree (anything else is ambiguous: refused)."""
        try:
            return leaf_dim_map(shape, self.element)
        except Refused:
            if is_carry or not node.users:
                raise
        found = set()
        for use in node.users:
            if use.target not in SIZE_ONE_VIEWS or use.args[0] is not node or \
                    any(a is node for a in (*use.args[1:], *use.kwargs.values())):
                raise Refused(f"a leaf of shape {shape} not broadcastable to {self.element}, used by {use.target}")
            out_shape = self._shape(use)  # the view read backwards gives the leaf its dims' places
            found.add(_view_map(out_shape, leaf_dim_map(out_shape, self.element), shape))
        if len(found) != 1:
            raise Refused(f"a leaf of shape {shape} placed onto {self.element} in different ways")
        return found.pop()

    def _shape(self, node):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise Refused(f"{node.name} has no tensor value")
        if not all(type(s) is int for s in val.shape):
            raise Refused("a symbolic shape in the body")
        return tuple(val.shape)

    def _operand(self, arg, as_type):
        if isinstance(arg, torch.fx.Node):
            text = self.value[arg]
            return text if as_type is None else f"{text}.to({as_type})"
        return literal(arg)

    def _translate(self, node):
        shape, target = self._shape(node), node.target
        self.shapes[node] = shape
        dtype = node.meta["val"].dtype
        out_type = compute_type(dtype)
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if any(a not in self.value for a in tensors):
            raise Refused(f"{node.name} reads a value that is not a tensor of the body")
        if self._is_accumulation(node, tensors):
            return
        summed = self._partial_of(node, tensors)
        if target in SIZE_ONE_VIEWS or target in EXPANDS or target in COPIES:
            src = node.args[0]
            if target in EXPANDS:
                self.maps[node] = _broadcast_map(shape, [(self.shapes[src], self.maps[src])])
            elif target in COPIES:
                self.maps[node] = self.maps[src]
            else:
                self.maps[node] = _view_map(self.shapes[src], self.maps[src], shape)
            self.value[node], self.dtypes[node] = self.value[src], dtype
            self._mark_partial(node, summed)
            return
        if target in _SUMS:
            expr, summed = self._sum(node, shape)
        elif target in CASTS:
            src = node.args[0]
            cast_target(node)  # refuses a _to_copy with other options
            if isinstance(src.meta.get("val"), torch.Tensor) and src.meta["val"].device != node.meta["val"].device:
                raise Refused("a copy to another device")
            expr = f"{self._operand(src, None)}{round_to(dtype)}"  # round through a narrow type
            expr = f"{expr}.to({out_type})" if dtype != torch.bool else f"({expr} != 0)"
            self.maps[node] = self.maps[src]
        elif target in CONSTANTS:
            expr = f"tl.full([BLOCK], {literal(constant_value(node))}, {out_type})"
            self.maps[node] = tuple(None for _ in shape)
        else:
            expr = expression(node, self._operand, out_type)
            if dtype != torch.bool:
                expr = f"({expr}).to({out_type})"
            self.maps[node] = _broadcast_map(shape, [(self.shapes[a], self.maps[a]) for a in tensors])
            if summed and any(j in summed for a in tensors if a not in self.partial for j in self.maps[a]):
                raise Refused("a partial sum times a value that varies along the summed dims")
        name = f"v{len(self.lines)}"
        self.lines.append(f"{name} = {expr}")
        self.value[node], self.dtypes[node] = name, dtype
        self._mark_partial(node, summed)

    def _mark_partial(self, node, summed):
        if summed:
            self.partial[node] = summed

    def _partial_of(self, node, tensors):
        """The summed dims of the partial sum ``node`` carries on (empty: not one); refuses a partial
        sum used in any way but a view, a cast, a product with or a division by a step value."""
        parts = [a for a in tensors if a in self.partial]
        if not parts:
            return frozenset()
        if node.target in _SUMMABLE and not node.kwargs and len(parts) == len(tensors) == 2 \
                and self.partial[parts[0]] == self.partial[parts[1]]:
            return self.partial[parts[0]]  # sum(u) + sum(v) = sum(u + v)
        linear = node.target in SIZE_ONE_VIEWS or node.target in COPIES or node.target in CASTS \
            or node.target in _LINEAR
        if len(parts) > 1 or not linear or (node.target is aten.div.Tensor and node.args[0] is not parts[0]):
            raise Refused(f"a sum over elements used by {node.target}")
        return self.partial[parts[0]]

    def _sum(self, node, shape):
        """A sum over dims of E: the lane's own value, the dims remembered (``partial``)."""
        src = node.args[0]
        if src in self.partial or set(node.kwargs) - {"dtype"} or node.kwargs.get("dtype") not in (None, node.meta["val"].dtype):
            raise Refused("a sum of a sum, or a sum with options")
        src_shape, src_map = self.shapes[src], self.maps[src]
        dims = range(len(src_shape)) if node.target is aten.sum.default or not node.args[1] else node.args[1]
        dims = {d % max(1, len(src_shape)) for d in dims}
        keepdim = len(node.args) > 2 and node.args[2]
        summed = set()
        for d in dims:
            if src_shape[d] != 1:
                if src_map[d] is None:
                    raise Refused("a sum along a broadcast dim")
                summed.add(src_map[d])
        self.maps[node] = tuple(None if d in dims else m for d, m in enumerate(src_map)) if keepdim \
            else tuple(m for d, m in enumerate(src_map) if d not in dims)
        if len(self.maps[node]) != len(shape):
            raise Refused("a sum of an unexpected shape")
        return f"{self._operand(src, compute_type(node.meta['val'].dtype))}", frozenset(summed)

    def _is_accumulation(self, node, tensors):
        """``add(carry, partial)`` where the carry is read nowhere else: kept aside for ``output``."""
        if node.target is not aten.add.Tensor or node.kwargs or len(tensors) != 2:
            return False
        carry = next((a for a in tensors if a.op == "placeholder" and len(a.users) == 1), None)
        other = next((a for a in tensors if a is not carry), None)
        if carry is None or other not in self.partial:
            return False
        self.accumulates[node] = (carry, other)
        return True

    def output(self, k: int, want: Leaf, is_carry: bool):
        """The text of the body's ``k``-th output, checked to be ``want`` (a shape broadcastable to E)
        element by element. ``Accumulated`` for a carry the body sums into, and for a y that is a sum
        over E dims (the gradient of an x row smaller than E): the kernel writes the lanes' values,
        the operator sums them."""
        node, dtype = self.outputs[k], want.dtype
        if node in self.partial and not is_carry:
            placed = self._sum_placed(k, node, want)
            return Accumulated(self.value[node], tuple(sorted(self.partial[node])), self._first(placed, node))
        if node in self.accumulates and is_carry:
            carry, part = self.accumulates[node]
            if self.placeholders.index(carry) != k or self.outputs.count(node) != 1:
                raise Refused(f"output {k} adds a sum to another carry")
            self._check_placed(k, part, want)
            placed = leaf_dim_map(want.shape, self.element)
            return Accumulated(self.value[part], tuple(sorted(self.partial[part])), self._first(placed, part))
        if not isinstance(node, torch.fx.Node) or node not in self.value or node in self.partial:
            raise Refused(f"output {k} is not a tensor of the body")
        self._check_placed(k, node, want)
        if self.dtypes[node] != dtype:
            raise Refused(f"output {k} is {self.dtypes[node]}, the scan's is {dtype}")
        return self.value[node]

    def _sum_placed(self, k, node, want):
        """The E dim of each dim of a y that is a sum over E dims: right-aligned when its shape
        broadcasts to E (checked as any output), else the sum's own map, which must give each dim
        of size > 1 an E dim, in E's order (the operator's reshape of the partials relies on it)."""
        try:
            placed = leaf_dim_map(want.shape, self.element)
        except Refused:
            placed = None
        if placed is not None:
            self._check_placed(k, node, want)
            return placed
        shape, dims = self.shapes[node], self.maps[node]
        kept = [m for m, size in zip(dims, shape) if size != 1]
        if shape != tuple(want.shape) or None in kept or kept != sorted(set(kept)):
            raise Refused(f"output {k} of shape {shape} is a sum whose dims are not {self.element}'s in order")
        return tuple(None if size == 1 else m for m, size in zip(dims, shape))

    def _first(self, placed, part):
        """The E dims along which every lane of the partial sum ``part`` holds the same value
        (``placed``: the E dim of each dim of the output)."""
        covered = {j for j in placed if j is not None}
        return tuple(j for j, size in enumerate(self.element)
                     if size != 1 and j not in covered and j not in self.partial[part])

    def _check_placed(self, k, node, want):
        shape, dims = self.shapes[node], self.maps[node]
        placed = leaf_dim_map(want.shape, self.element)
        if shape != tuple(want.shape) or any(m not in (j, None) for j, m, size in zip(placed, dims, shape) if size != 1):
            raise Refused(f"output {k} of shape {shape} is not {tuple(want.shape)} of {self.element} element by element")
