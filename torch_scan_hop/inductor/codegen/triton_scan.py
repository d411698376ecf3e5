"""A scan whose body is pointwise in its carries, as the source of ONE Triton kernel with the time loop inside.

Why: lowered as a ``while_loop``, a scan on a GPU launches the body's kernels once per step; a
recurrence such as ``h = a * h + b`` (RG-LRU, Mamba's state update, RWKV's wkv) does a few flops
per element per step, so the launches are the whole cost. When every op of the body is pointwise
(``triton_ops``), element ``e`` of the new carry depends only on element ``e`` of the carry and of
the step's inputs: one program can own a block of elements and walk all T steps with the carry in
registers (as mamba_ssm's selective-scan kernel does). The backward of such a body is again such
a scan (reversed), so a training step gets the same treatment per scan node.

The source is a pure function of the body graph and the signature (element shape, dtypes, reverse;
not T: the number of steps is a launch argument, so one source serves every length and a compiled
graph whose length is symbolic gets the kernel too), self-contained (a compiled graph holding it needs nothing else of this process). Strides
are ``tl.constexpr`` parameters given at launch from the real tensors: inductor may pad or relayout
a buffer after the graph was traced, and Triton specializes on their values anyway. Its first line
holds what the operator's fake and real implementations need (``read_header``).

The element space E is the shape every carry and y row broadcasts to, or the carries' when a y row
is a sum over E dims that does not (``triton_body`` checks that every value maps onto it); a program
owns BLOCK consecutive elements of E flattened, with int64 offsets, and walks the steps in an
unrolled loop (``_Step``).
"""
import dataclasses
import json
import math
import os
from typing import Optional

import torch

from .triton_body import Accumulated, Body, Leaf, leaf_dim_map
from .triton_ops import FLOATS, HELPERS, Refused, compute_type, round_to

KERNEL_NAME = "pointwise_scan_kernel"
UNROLL = 8  # steps per iteration of the time loop (``_Step``)
_HEADER = "# torch_scan_hop pointwise scan: "
# T, the number of steps, is a launch argument: one compiled kernel for every length. Triton 3.5's
# interpreter (tests on the CPU) cannot loop to a bound passed at run time, so a source generated
# there takes T as a constant (Triton then compiles it per length); the GPU's text is compiled by
# the tests too (``check_compiles_for_cuda``).
_T_PARAM = "T: tl.constexpr" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "T"


def _helpers():
    """The kernel module's ``_<name>(x)`` helpers, chosen when the module loads (``TRITON_INTERPRET``)."""
    def defs(body_of):
        return [line for name, interpreted in HELPERS.items()
                for line in ("    @triton.jit", f"    def _{name}(x):", f"        return {body_of(name, interpreted)}", "")]
    return "\n".join(["", '_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"', "if _INTERPRET:",
                      *defs(lambda name, interpreted: interpreted), "else:",
                      "    from triton.language.extra import libdevice", "",
                      *defs(lambda name, interpreted: f"libdevice.{name}(x)")])


_HELPERS = _helpers()


@dataclasses.dataclass(frozen=True)
class Signature:
    """What the kernel's text depends on besides the body: the element shape, the number of steps,
    the carries (a carry smaller than E is one the body sums into, ``triton_body``), the x rows and
    closed-over tensors, the ys (rows broadcastable to E: a value a backward saves may be smaller),
    the direction."""

    element_shape: tuple
    length: Optional[int]  # None: symbolic (the operator takes it from the xs)
    carries: tuple  # Leaf per carry
    xs: tuple  # Leaf per x (row shape)
    lifted: tuple  # Leaf per closed-over tensor
    ys: tuple  # Leaf per y (row shape)
    reverse: bool


def _header(sig, outs):
    """The source's first line: what the operator's fake and real implementations need."""
    leaves = lambda ls: [[str(v.dtype), list(v.shape)] for v in ls]  # noqa: E731
    acc = {str(k): [list(o.summed), list(o.first)] for k, o in enumerate(outs) if isinstance(o, Accumulated)}
    data = {"E": list(sig.element_shape), "T": None if sig.xs else sig.length, "carries": leaves(sig.carries), "ys": leaves(sig.ys),
            "nx": len(sig.xs), "nl": len(sig.lifted), "reverse": sig.reverse, "acc": acc}
    return _HEADER + json.dumps(data, sort_keys=True)


def read_header(source: str) -> dict:
    """The first line of a kernel source: ``E``, ``T`` (None where the xs give it), ``carries`` and ``ys`` (``Leaf`` each), ``nx``,
    ``nl``, ``reverse``, ``acc`` ({output index: (summed E dims, E dims taken at 0)}: the kernel writes
    an E-shaped partial there, in the compute dtype)."""
    first = source.split("\n", 1)[0]
    if not first.startswith(_HEADER):
        raise ValueError("not a pointwise scan kernel source")
    data = json.loads(first[len(_HEADER):])
    to_dtype = {str(d): d for d in (*FLOATS, torch.bool)}
    for key in ("carries", "ys"):
        data[key] = [Leaf(tuple(shape), to_dtype[d]) for d, shape in data[key]]
    data["E"] = tuple(data["E"])
    data["acc"] = {int(k): (tuple(v[0]), tuple(v[1])) for k, v in data["acc"].items()}
    return data


def kernel_source(body: torch.fx.GraphModule, sig: Signature) -> str:
    """The Triton source of ``body`` scanned as ``sig`` says, or raise ``Refused``."""
    nc, nx, nl, ny = len(sig.carries), len(sig.xs), len(sig.lifted), len(sig.ys)
    for leaf in (*sig.carries, *(y for y in sig.ys if y.dtype != torch.bool)):
        if leaf.dtype not in FLOATS:
            raise Refused(f"a carry or y of dtype {leaf.dtype}")
    names = [*(f"h{k}" for k in range(nc)), *(f"a{k}" for k in range(nx)), *(f"w{k}" for k in range(nl))]
    translated = Body(body, sig.element_shape, [*sig.carries, *sig.xs, *sig.lifted], names, carries=nc)
    if len(translated.outputs) != nc + ny:
        raise Refused(f"the body returns {len(translated.outputs)} values, the scan has {nc + ny}")
    outs = [translated.output(k, want, k < nc) for k, want in enumerate((*sig.carries, *sig.ys))]
    if any(
            tuple(c.shape) != tuple(sig.element_shape) and not isinstance(o, Accumulated)
            for c, o in zip(sig.carries, outs)):
        raise Refused("a carry of another shape than the element space that is not a sum")
    return "\n".join([_header(sig, outs), "import os", "import triton", "import triton.language as tl", _HELPERS,
                      *_kernel(sig, translated.lines, outs, translated.leaf_maps)]) + "\n"


def _coords(element_shape):
    """Lines giving each E dim's coordinate ``e<j>`` of the flat element index ``offs``."""
    lines, inner = [], 1
    for j in reversed(range(len(element_shape))):
        div = f"offs // {inner}" if inner != 1 else "offs"
        lines.append(f"e{j} = ({div}) % {element_shape[j]}" if j else f"e{j} = {div}")
        inner *= element_shape[j]
    return lines


def _offset(name, dims):
    """The int64 element offset of leaf ``name`` (strides ``<name>_s<d>``) at the lane's element, its
    dims placed on E's by ``dims`` (the body's map of that leaf: one source of truth)."""
    terms = [f"e{j} * {name}_s{d}" for d, j in enumerate(dims) if j is not None]
    return " + ".join(terms) if terms else "zero"


def _row_offset(shape, element_shape):
    """The offset of the lane's element in a contiguous y row of ``shape`` (broadcastable to E)."""
    if tuple(shape) == tuple(element_shape):
        return "offs"
    dims, terms, stride = leaf_dim_map(shape, element_shape), [], 1
    for d in reversed(range(len(shape))):
        if dims[d] is not None:
            terms.append(f"e{dims[d]} * {stride}")
        stride *= shape[d]
    return " + ".join(terms) if terms else "zero"


def _first_lanes(shape, element_shape):
    """The store mask of a y smaller than E: only the lanes at 0 along the E dims it is broadcast over
    (every lane computes the same value there)."""
    covered = {j for j in leaf_dim_map(shape, element_shape) if j is not None}
    return " & ".join(["mask", *(f"(e{j} == 0)" for j in range(len(element_shape)) if j not in covered
                                 and element_shape[j] != 1)])


def _kernel(sig, body_lines, outs, leaf_maps):
    nc, nx, nl, ny = len(sig.carries), len(sig.xs), len(sig.lifted), len(sig.ys)
    carry_maps, x_maps, lifted_maps = leaf_maps[:nc], leaf_maps[nc:nc + nx], leaf_maps[nc + nx:]
    E = sig.element_shape
    acc = {k for k, o in enumerate(outs) if isinstance(o, Accumulated)}
    ys = [Leaf(E, None) if nc + k in acc else y for k, y in enumerate(sig.ys)]  # a summed y: E-shaped partials
    strides = [*(f"h{k}_in_s{d}" for k, c in enumerate(sig.carries) for d in range(len(c.shape))),
               *(f"a{k}_s{d}" for k, x in enumerate(sig.xs) for d in range(len(x.shape))),
               *(f"a{k}_st" for k in range(nx)),
               *(f"w{k}_s{d}" for k, w in enumerate(sig.lifted) for d in range(len(w.shape)))]
    ptrs = [*(f"h{k}_in" for k in range(nc)), *(f"a{k}_ptr" for k in range(nx)), *(f"w{k}_ptr" for k in range(nl)),
            *(f"h{k}_out" for k in range(nc)), *(f"y{k}_ptr" for k in range(ny))]
    params = ", ".join([*ptrs, _T_PARAM, *(f"{s}: tl.constexpr" for s in strides), "N: tl.constexpr",
                        "BLOCK: tl.constexpr"])
    load = "tl.load({}, mask=mask, other=0).to({})"
    out = ["offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
           "mask = offs < N", "zero = offs * 0", *_coords(E)]
    for k, c in enumerate(sig.carries):
        ct = compute_type(c.dtype)
        out.append(f"r{k} = tl.zeros([BLOCK], {ct})" if k in acc else
                   f"h{k} = " + load.format(f"h{k}_in + ({_offset(f'h{k}_in', carry_maps[k])})", ct))
    for k, w in enumerate(sig.lifted):
        out.append(f"w{k} = " + load.format(f"w{k}_ptr + ({_offset(f'w{k}', lifted_maps[k])})", compute_type(w.dtype)))
    start = " + (zero + (T - 1)) * " if sig.reverse else None  # int64: (T - 1) * stride may pass 2**31
    for k, x in enumerate(sig.xs):
        out.append(f"p{k} = a{k}_ptr + ({_offset(f'a{k}', x_maps[k])})" + (f"{start}a{k}_st" if start else ""))
    for k, y in enumerate(ys):
        out.append(f"q{k} = y{k}_ptr + ({_row_offset(y.shape, E)})" + (f"{start}{math.prod(y.shape)}" if start else ""))
        out.append(f"m{k} = {_first_lanes(y.shape, E)}")
    carried = [k for k in range(nc) if k not in acc]
    summed = sorted(k for k in acc if k < nc)
    step = _Step(sig, ys, body_lines, outs, carried, summed)
    unroll = UNROLL if len(body_lines) <= 64 else UNROLL // 2
    loops = [*step.loop(f"T // {unroll}", unroll), *step.loop(f"T % {unroll}", 1)]
    end = [f"tl.store(h{k}_out + offs, h{k}.to(h{k}_out.dtype.element_ty), mask=mask)" for k in carried]
    end += [f"tl.store(h{k}_out + offs, r{k}.to(h{k}_out.dtype.element_ty), mask=mask)" for k in summed]
    return ["", "", "@triton.jit", f"def {KERNEL_NAME}({params}):", *("    " + line for line in (*out, *loops, *end))]


class _Step:
    """The time loop's text: ``loop(count, unroll)`` runs ``count`` iterations of ``unroll`` steps each.
    Why unrolled: a step's loads do not depend on the carry, but a thread stalls at the first use of
    a load; with the loads of ``unroll`` steps written first, one memory latency covers them all
    (the loop is latency bound: a few flops per element per step)."""

    def __init__(self, sig, ys, body_lines, outs, carried, summed):
        self.sig, self.ys, self.body, self.outs, self.carried, self.summed = sig, ys, body_lines, outs, carried, summed
        self.sign = "-" if sig.reverse else "+"

    def _at(self, pointer, i, stride):
        return pointer if i == 0 else f"{pointer} {self.sign} {i} * {stride}"

    def loop(self, count, unroll):
        sig, nc = self.sig, len(self.sig.carries)
        loads, steps = [], []
        for i in range(unroll):
            loads += [f"a{k}_{i} = tl.load({self._at(f'p{k}', i, f'a{k}_st')}, mask=mask, other=0)"
                      f".to({compute_type(x.dtype)})" for k, x in enumerate(sig.xs)]
            steps += [f"a{k} = a{k}_{i}" for k in range(len(sig.xs))] + list(self.body)
            ytext = [o.text if isinstance(o, Accumulated) else o for o in self.outs[nc:]]
            steps += [f"tl.store({self._at(f'q{k}', i, math.prod(y.shape))}, ({ytext[k]}).to(y{k}_ptr.dtype.element_ty), "
                      f"mask=m{k})" for k, y in enumerate(self.ys)]
            steps += [f"r{k} = r{k} + ({self.outs[k].text}).to({compute_type(sig.carries[k].dtype)})"
                      for k in self.summed]
            steps += [f"n{k} = ({self.outs[k]}){round_to(sig.carries[k].dtype)}.to({compute_type(sig.carries[k].dtype)})"
                      for k in self.carried]
            steps += [f"h{k} = n{k}" for k in self.carried]
        advance = [f"p{k} {self.sign}= {unroll} * a{k}_st" for k in range(len(sig.xs))]
        advance += [f"q{k} {self.sign}= {unroll * math.prod(y.shape)}" for k, y in enumerate(self.ys)]
        return [f"for t in range({count}):", *("    " + line for line in (*loads, *steps, *advance))]
