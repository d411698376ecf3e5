"""A scan whose body is pointwise in its carries, as the source of ONE Triton kernel with the time loop inside.

Why: lowered as a ``while_loop``, a scan on a GPU launches the body's kernels once per step; a
recurrence such as ``h = a * h + b`` (RG-LRU, Mamba's state update, RWKV's wkv) does a few flops
per element per step, so the launches are the whole cost. When every op of the body is pointwise
(``triton_ops``), element ``e`` of the new carry depends only on element ``e`` of the carry and of
the step's inputs: one program can own a block of elements and walk all T steps with the carry in
registers (as mamba_ssm's selective-scan kernel does). The backward of such a body is again such
a scan (reversed), so a training step gets the same treatment per scan node.

The source is a pure function of the body graph and the signature (element shape, T, dtypes,
reverse), self-contained (it survives inductor's FX graph cache into a new process). Strides are
``tl.constexpr`` parameters given at launch from the real tensors: inductor may pad or relayout a
buffer after the graph was traced, and Triton specializes on their values anyway. Its first line
holds what the operator's fake implementation needs (``header``/``read_header``).

The element space E is the common shape of every carry and every y. Every other value is tracked
as a map from its dims to E's dims (None: constant along that dim); a leaf (x row, closed-over
tensor) is broadcast to E right-aligned, as the body's own broadcasting does. Anything that does
not map back onto E dim by dim (a reshape that moves data, a value of another shape stored as a
carry) refuses the whole scan (``Refused``).
"""
import dataclasses
import json
import torch

from .triton_ops import (CASTS, CONSTANTS, COPIES, EXPANDS, FLOATS, SIZE_ONE_VIEWS, Refused, cast_target,
                         compute_type, constant_value, expression, literal)

KERNEL_NAME = "pointwise_scan_kernel"
_HEADER = "# torch_scan_hop pointwise scan: "

_HELPERS = '''
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if _INTERPRET:  # the interpreter has no libdevice; these are for tests on the CPU
    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _log1p(x):
        return tl.log(1.0 + x)

    @triton.jit
    def _expm1(x):
        return tl.exp(x) - 1.0

    @triton.jit
    def _sqrt(x):
        return tl.sqrt(x)

    @triton.jit
    def _rsqrt(x):
        return 1.0 / tl.sqrt(x)
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _tanh(x):
        return libdevice.tanh(x)

    @triton.jit
    def _log1p(x):
        return libdevice.log1p(x)

    @triton.jit
    def _expm1(x):
        return libdevice.expm1(x)

    @triton.jit
    def _sqrt(x):
        return libdevice.sqrt(x)

    @triton.jit
    def _rsqrt(x):
        return libdevice.rsqrt(x)
'''


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A tensor the kernel reads: its shape (an x's row shape, without the step dim) and dtype."""

    shape: tuple
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Signature:
    """What the kernel's text depends on besides the body: the element shape, the number of steps,
    the carries' and ys' dtypes, the x rows and closed-over tensors, the direction."""

    element_shape: tuple
    length: int
    carries: tuple  # dtypes
    xs: tuple  # Leaf per x (row shape)
    lifted: tuple  # Leaf per closed-over tensor
    ys: tuple  # dtypes
    reverse: bool


def header(sig: Signature) -> str:
    """The source's first line: element shape, length, output dtypes (read by the fake implementation)."""
    data = {"E": list(sig.element_shape), "T": sig.length, "carries": [str(d) for d in sig.carries],
            "ys": [str(d) for d in sig.ys], "nx": len(sig.xs), "nl": len(sig.lifted), "reverse": sig.reverse}
    return _HEADER + json.dumps(data, sort_keys=True)


def read_header(source: str) -> dict:
    """The first line of a kernel source as written by ``header`` (dtypes as torch dtypes)."""
    first = source.split("\n", 1)[0]
    if not first.startswith(_HEADER):
        raise ValueError("not a pointwise scan kernel source")
    data = json.loads(first[len(_HEADER):])
    to_dtype = {str(d): d for d in FLOATS}
    data["carries"] = [to_dtype[d] for d in data["carries"]]
    data["ys"] = [to_dtype[d] for d in data["ys"]]
    data["E"] = tuple(data["E"])
    return data


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


class _Body:
    """The body graph translated statement by statement into the loop's Triton text."""

    def __init__(self, body, sig, names):
        self.sig, self.lines, self.value, self.maps, self.dtypes = sig, [], {}, {}, {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        leaves = [*(Leaf(sig.element_shape, d) for d in sig.carries), *sig.xs, *sig.lifted]
        if len(placeholders) != len(leaves):
            raise Refused(f"the body takes {len(placeholders)} inputs, the scan passes {len(leaves)}")
        for node, leaf, name in zip(placeholders, leaves, names):
            self.value[node], self.dtypes[node] = name, leaf.dtype
            self.maps[node] = leaf_dim_map(leaf.shape, sig.element_shape)
        self.outputs = None
        for node in body.graph.nodes:
            if node.op == "call_function":
                self._translate(node)
            elif node.op == "output":
                self.outputs = list(node.args[0])
            elif node.op != "placeholder":
                raise Refused(f"a {node.op} node in the body")

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
        dtype = node.meta["val"].dtype
        out_type = compute_type(dtype)
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if any(a not in self.value for a in tensors):
            raise Refused(f"{node.name} reads a value that is not a tensor of the body")
        if target in SIZE_ONE_VIEWS or target in EXPANDS or target in COPIES:
            src = node.args[0]
            if target in EXPANDS:
                self.maps[node] = _broadcast_map(shape, [(self._shape_of(src), self.maps[src])])
            elif target in COPIES:
                self.maps[node] = self.maps[src]
            else:
                self.maps[node] = _view_map(self._shape_of(src), self.maps[src], shape)
            self.value[node], self.dtypes[node] = self.value[src], dtype
            return
        if target in CASTS:
            src = node.args[0]
            expr = self._operand(src, None)
            if dtype in (torch.float16, torch.bfloat16):
                expr = f"{expr}.to({FLOATS[dtype]})"  # round through the narrow type
            expr = f"{expr}.to({out_type})" if dtype != torch.bool else f"({expr} != 0)"
            self.maps[node] = self.maps[src]
        elif target in CONSTANTS:
            expr = f"tl.full([BLOCK], {literal(constant_value(node))}, {out_type})"
            self.maps[node] = tuple(None for _ in shape)
        else:
            expr = expression(node, self._operand, out_type)
            if dtype != torch.bool:
                expr = f"({expr}).to({out_type})"
            self.maps[node] = _broadcast_map(shape, [(self._shape_of(a), self.maps[a]) for a in tensors])
        name = f"v{len(self.lines)}"
        self.lines.append(f"{name} = {expr}")
        self.value[node], self.dtypes[node] = name, dtype

    def _shape_of(self, node):
        if node.op == "placeholder":
            k = [n for n in node.graph.nodes if n.op == "placeholder"].index(node)
            return self._leaf_shapes()[k]
        return self._shape(node)

    def _leaf_shapes(self):
        sig = self.sig
        return [*(sig.element_shape for _ in sig.carries), *(x.shape for x in sig.xs), *(l.shape for l in sig.lifted)]

    def output(self, k, dtype) -> str:
        """The text of the body's ``k``-th output, checked to be E-shaped element by element."""
        node = self.outputs[k]
        if not isinstance(node, torch.fx.Node) or node not in self.value:
            raise Refused(f"output {k} is not a tensor of the body")
        shape, dims = self._shape_of(node), self.maps[node]
        element = self.sig.element_shape
        if shape != element or any(m not in (j, None) for j, m in enumerate(dims)):
            raise Refused(f"output {k} of shape {shape} is not the carry's {element} element by element")
        if self.dtypes[node] != dtype:
            raise Refused(f"output {k} is {self.dtypes[node]}, the scan's is {dtype}")
        return self.value[node]


def kernel_source(body: torch.fx.GraphModule, sig: Signature) -> str:
    """The Triton source of ``body`` scanned as ``sig`` says, or raise ``Refused``."""
    nc, nx, nl, ny = len(sig.carries), len(sig.xs), len(sig.lifted), len(sig.ys)
    for dtype in (*sig.carries, *sig.ys):
        if dtype not in FLOATS:
            raise Refused(f"a carry or y of dtype {dtype}")
    names = [*(f"h{k}" for k in range(nc)), *(f"a{k}" for k in range(nx)), *(f"w{k}" for k in range(nl))]
    translated = _Body(body, sig, names)
    if len(translated.outputs) != nc + ny:
        raise Refused(f"the body returns {len(translated.outputs)} values, the scan has {nc + ny}")
    outs = [translated.output(k, d) for k, d in enumerate((*sig.carries, *sig.ys))]
    return "\n".join([header(sig), "import os", "import triton", "import triton.language as tl", _HELPERS,
                      *_kernel(sig, translated.lines, outs)]) + "\n"


def _coords(element_shape):
    """Lines giving each E dim's coordinate ``e<j>`` of the flat element index ``offs``."""
    lines, inner = [], 1
    for j in reversed(range(len(element_shape))):
        div = f"offs // {inner}" if inner != 1 else "offs"
        lines.append(f"e{j} = ({div}) % {element_shape[j]}" if j else f"e{j} = {div}")
        inner *= element_shape[j]
    return lines


def _offset(name, shape, element_shape):
    """The int64 element offset of leaf ``name`` (strides ``<name>_s<d>``) at the lane's element."""
    dims = leaf_dim_map(shape, element_shape)
    terms = [f"e{j} * {name}_s{d}" for d, j in enumerate(dims) if j is not None]
    return " + ".join(terms) if terms else "zero"


def _kernel(sig, body_lines, outs):
    nc, nx, nl, ny = len(sig.carries), len(sig.xs), len(sig.lifted), len(sig.ys)
    E, T1 = sig.element_shape, sig.length - 1
    strides = [*(f"h{k}_in_s{d}" for k in range(nc) for d in range(len(E))),
               *(f"a{k}_s{d}" for k, x in enumerate(sig.xs) for d in range(len(x.shape))),
               *(f"a{k}_st" for k in range(nx)),
               *(f"w{k}_s{d}" for k, w in enumerate(sig.lifted) for d in range(len(w.shape)))]
    ptrs = [*(f"h{k}_in" for k in range(nc)), *(f"a{k}_ptr" for k in range(nx)), *(f"w{k}_ptr" for k in range(nl)),
            *(f"h{k}_out" for k in range(nc)), *(f"y{k}_ptr" for k in range(ny))]
    params = ", ".join([*ptrs, *(f"{s}: tl.constexpr" for s in strides),
                        "N: tl.constexpr", "T: tl.constexpr", "BLOCK: tl.constexpr"])
    load = "tl.load({}, mask=mask, other=0).to({})"
    out = ["", "", "@triton.jit", f"def {KERNEL_NAME}({params}):",
           "offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
           "mask = offs < N", "zero = offs * 0", *_coords(E)]
    for k, dtype in enumerate(sig.carries):
        out.append(f"h{k} = " + load.format(f"h{k}_in + ({_offset(f'h{k}_in', E, E)})", compute_type(dtype)))
    for k, w in enumerate(sig.lifted):
        out.append(f"w{k} = " + load.format(f"w{k}_ptr + ({_offset(f'w{k}', w.shape, E)})", compute_type(w.dtype)))
    start = f" + {T1} * " if sig.reverse else None
    for k, x in enumerate(sig.xs):
        first = f"{start}a{k}_st" if start else ""
        out.append(f"p{k} = a{k}_ptr + ({_offset(f'a{k}', x.shape, E)}){first}")
    for k in range(ny):
        out.append(f"q{k} = y{k}_ptr + offs" + (f"{start}N" if start else ""))
    out.append("for t in range(T):")
    loop = [f"a{k} = " + load.format(f"p{k}", compute_type(x.dtype)) for k, x in enumerate(sig.xs)]
    loop += body_lines
    loop += [f"tl.store(q{k}, ({outs[nc + k]}).to(y{k}_ptr.dtype.element_ty), mask=mask)" for k in range(ny)]
    loop += [f"n{k} = ({outs[k]}).to({compute_type(d)})" for k, d in enumerate(sig.carries)]
    loop += [f"h{k} = n{k}" for k in range(nc)]
    step = "-=" if sig.reverse else "+="
    loop += [f"p{k} {step} a{k}_st" for k in range(nx)] + [f"q{k} {step} N" for k in range(ny)]
    end = [f"tl.store(h{k}_out + offs, h{k}.to(h{k}_out.dtype.element_ty), mask=mask)" for k in range(nc)]
    head, body = out[:4], out[4:]
    return [*head, *("    " + line for line in body), *("        " + line for line in loop),
            *("    " + line for line in end)]
