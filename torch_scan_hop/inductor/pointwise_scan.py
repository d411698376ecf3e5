"""A GPU scan whose body is pointwise in its carries, run as ONE Triton kernel (the pass and its operator).

Why: lowered to a ``while_loop``, each step of a scan on CUDA launches the body's kernels; for a
recurrence such as ``h = a * h + b`` per channel (RG-LRU, Mamba, RWKV's wkv) those launches are the
whole cost. ``codegen.triton_scan`` writes such a body as one kernel whose programs walk all T
steps with the carry in registers. This post-grad pass runs before the scan lowering
(``lowering.install``) and replaces each scan node it can (CUDA tensors, static shapes, a pointwise
body, every carry and y of one shape) by a call to ``torch_scan_hop::pointwise_scan``, which takes
the kernel's SOURCE as a string: the compiled graph stays self-contained through inductor's FX
graph cache, and the kernel is built (once per source, by hash) at its first run. The pass counts
per scan node under ``pointwise_scan_kernel`` in ``codegen.pass_counts()`` (applied, skipped,
failed). It is opt-in (``kernels_enabled``, ``SCAN_POINTWISE_KERNEL=1``; why: its docstring), and
``codegen.passes_off("pointwise_scan_kernel")`` turns it off inside an enabled block. A node it
refuses is left exactly as it was, for the loop lowering; a generator error warns once and also
leaves it.

A training step's backward scan is another scan node (reversed) whose body is again pointwise for
such recurrences: it gets the same treatment here, with no special case.
"""
import base64
import contextlib
import functools
import hashlib
import importlib.util
import math
import os
import tempfile
import logging
import threading
import warnings
import zlib
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import _compat
from .codegen import pipeline, triton_scan
from .codegen.triton_ops import Refused

log = logging.getLogger("torch_scan_hop.inductor.pointwise_scan")
PASS_NAME = "pointwise_scan_kernel"
ENV = "SCAN_POINTWISE_KERNEL"  # "1": the pass runs (``kernels_enabled``)
_enabled = [os.environ.get(ENV) == "1"]
DEVICE_TYPES = {"cuda"}  # the CPU has its C++ loop kernel; tests add "cpu" under Triton's interpreter
_SCAN = torch.ops.higher_order.scan


@contextlib.contextmanager
def kernels_enabled(on: bool = True):
    """Within this block the pass runs (``on``) or not, whatever ``SCAN_POINTWISE_KERNEL`` says.

    Why opt-in: on an H200 (torch 2.11) the kernel ran forward graphs and the training steps of
    the linear and Mamba bodies, but inductor failed to load the wrapper it generated for the
    training steps of bodies with closed-over tensors or math functions ("SyntaxError: unmatched
    ')'"). The cause, found since on the CPU with inductor's kernels in Triton beside ours: inductor
    copies the scan node's text into a wrapper comment, and the source, then a multi-line string
    argument, ended that comment; ``pack`` makes it one token. Until a GPU run shows those steps
    right on CUDA, the loop lowering stays the default.

    Example:
        >>> with kernels_enabled():
        ...     ys = torch.compile(f)(h0, a, b)  # compiled here: its pointwise scans are one kernel
    """
    before = _enabled[0]
    _enabled[0] = on
    try:
        yield
    finally:
        _enabled[0] = before


class PointwiseScanWarning(RuntimeWarning):
    """The pointwise scan kernel could not be generated for a scan: it runs as a loop (right, slower)."""


def plan(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[Optional[str], str]:
    """``(kernel source, "")`` for a scan node the pass applies to, else ``(None, why not)``."""
    try:
        return triton_scan.kernel_source(*_body_and_signature(gm, node)), ""
    except Refused as refused:
        return None, str(refused)


def _on_kernel_device(node):
    """Whether every tensor the scan node reads or makes is on one device of ``DEVICE_TYPES`` (checked
    first and quietly: a CPU scan is none of this pass's business)."""
    vals = node.meta.get("val")
    vals = [*vals] if isinstance(vals, (list, tuple)) else [vals]
    for group in node.args[1:4]:
        vals += [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in (group or ())] \
            if isinstance(group, (list, tuple)) else [None]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    devices = {v.device for v in tensors}
    return len(devices) == 1 and next(iter(devices)).type in DEVICE_TYPES


def _val(arg):
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise Refused(f"an operand that is not a tensor: {arg!r}")
    return val


def _body_and_signature(gm, node):
    if set(node.kwargs) - {"reverse"} or len(node.args) != 4:
        raise Refused("a scan with options other than reverse")
    combine, init, xs, lifted = node.args
    if not isinstance(combine, torch.fx.Node) or combine.op != "get_attr":
        raise Refused("a body that is not a subgraph")
    inits, rows, closed = [_val(a) for a in init], [_val(a) for a in xs], [_val(a) for a in lifted]
    outs = node.meta.get("val")
    if not isinstance(outs, (list, tuple)) or not all(isinstance(v, torch.Tensor) for v in outs):
        raise Refused("outputs that are not tensors")
    everything = [*inits, *rows, *closed, *outs]
    if not everything or len({v.device for v in everything}) != 1 or everything[0].device.type not in DEVICE_TYPES:
        raise Refused(f"devices {sorted({str(v.device) for v in everything})}")
    nc = len(inits)
    ys = outs[nc:]
    if not all(type(s) is int for v in (*inits, *closed, *outs[:nc]) for s in (*v.shape, *v.stride())):
        raise Refused("dynamic shapes other than the length")
    length = _length(rows, ys)
    if length == 0:
        raise Refused("a scan of no steps (or of unknown length)")
    element = _element_shape([c.shape for c in (*inits, *outs[:nc])], [y.shape[1:] for y in ys])
    if math.prod(element) == 0 or not all(_contiguous(v.shape[lead:], v.stride()[lead:]) and
                                          (not lead or v.stride(0) == math.prod(v.shape[1:]))
                                          for lead, v in [*((0, c) for c in outs[:nc]), *((1, y) for y in ys)]):
        raise Refused("an empty or non-contiguous output")
    sig = triton_scan.Signature(
        element_shape=element, length=length, carries=tuple(triton_scan.Leaf(tuple(v.shape), v.dtype) for v in inits),
        xs=tuple(triton_scan.Leaf(tuple(x.shape[1:]), x.dtype) for x in rows),
        lifted=tuple(triton_scan.Leaf(tuple(w.shape), w.dtype) for w in closed),
        ys=tuple(triton_scan.Leaf(tuple(y.shape[1:]), y.dtype) for y in ys), reverse=bool(node.kwargs.get("reverse", False)))
    return getattr(gm, combine.target), sig


def _contiguous(shape, strides):
    """Row-major strides of ``shape`` (static sizes; a y's symbolic length is checked apart, with no
    guard on its value)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _length(rows, ys):
    """The number of steps: an int, or None when it is symbolic (only the xs' and ys' leading dim may
    be; every other size and every stride must be static, and the xs must give the length)."""
    leading = [v.shape[0] for v in (*rows, *ys)]
    rest = [s for v in (*rows, *ys) for s in (*v.shape[1:], *v.stride())]
    if not leading or not all(type(s) is int for s in rest):
        raise Refused("dynamic shapes other than the length")
    if all(type(n) is int for n in leading):
        if len(set(leading)) != 1:
            raise Refused("xs of different lengths")
        return leading[0]
    if not rows or not all(statically_known_true(n == leading[0]) for n in leading):
        raise Refused("a symbolic length the xs do not all give")
    return None


def _element_shape(carries, rows):
    """E: the shape every carry and y row broadcasts to (a carry smaller than E must be a sum the
    body accumulates, which the generator checks). When some y rows do not broadcast (Mamba's
    ``(h * C_t).sum(-1)``: E without its last dim), E comes from the carries and the rows that
    broadcast with them; the generator accepts such a y only as a sum over E dims whose other
    dims are E's, in order."""
    shapes = [*map(tuple, carries), *map(tuple, rows)]
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        pass
    try:
        of_carries = torch.broadcast_shapes(*carries)
        return tuple(torch.broadcast_shapes(*carries, *(r for r in rows if _broadcasts(of_carries, r))))
    except RuntimeError:
        raise Refused(f"carries and y rows of shapes {sorted(set(shapes))}") from None


def _broadcasts(a, b):
    try:
        torch.broadcast_shapes(a, b)
        return True
    except RuntimeError:
        return False


def lower_pointwise_scans(gm: torch.fx.GraphModule) -> int:
    """Replace every scan node of ``gm`` that ``plan`` accepts by the operator; how many were."""
    sources = {}

    def accepts(match):
        node = match.nodes[0]
        if node in sources:
            return sources[node] is not None
        sources[node] = _decide(gm, node)
        return sources[node] is not None

    bodies = []

    def replace(match, combine, init, xs, lifted, **kwargs):
        source, nc, nx = sources[match.nodes[0]], len(init), len(xs)
        reverse = bool(kwargs.get("reverse", False))
        bodies.append(combine)

        def kernel_call(*flat):
            # one statement a line: the nodes traced here carry this frame as their stack trace,
            # which inductor may copy into its wrapper as a comment (Python 3.12+ shows a
            # statement's every line; the second would not be a comment)
            args = (pack(source), list(flat[:nc]), list(flat[nc:nc + nx]), list(flat[nc + nx:]), reverse)
            out = torch.ops.torch_scan_hop.pointwise_scan.default(*args)
            return out if len(out) != 1 else [*out, out[0]]  # see lowering._as_multi_output

        match.replace_by_example(kernel_call, [*init, *xs, *lifted], run_functional_passes=False)

    _compat.inductor.call_pattern_pass(_SCAN, accepts, replace).apply(gm)
    applied = sum(s is not None for s in sources.values())
    if applied:
        for body in dict.fromkeys(bodies):  # the replaced scans' subgraphs, now read by nothing
            if not body.users:
                gm.graph.erase_node(body)
        gm.graph.lint()
        gm.recompile()
    return applied


def _decide(gm, node):
    """The source for ``node`` or None, counted (and warned once when the generator fails)."""
    if not _enabled[0] or pipeline.is_off(PASS_NAME) or not _on_kernel_device(node):
        pipeline.record(PASS_NAME, "skipped")
        return None
    try:
        source, why = plan(gm, node)
    except Exception as error:  # noqa: BLE001 - a generator bug must not break the compile: keep the loop
        pipeline.record(PASS_NAME, "failed")
        warnings.warn(f"torch_scan_hop: the pointwise scan kernel could not be generated ({type(error).__name__}: "
                      f"{error}); the scan runs as a loop. Please report it.", PointwiseScanWarning, stacklevel=2)
        return None
    pipeline.record(PASS_NAME, "applied" if source is not None else "skipped")
    if source is None:
        log.debug("pointwise scan kernel not used for %s: %s", node.name, why)
    return source


# ---- the operator -------------------------------------------------------------------------------

_PACKED = "zb64:"


def pack(source: str) -> str:
    """``source`` as one token of letters, digits and ``+/=`` (zlib, then base64): the compiled
    graph holds it as a string argument, and inductor writes that into its Python wrapper, and
    may into comments and kernel metadata: a text of one line with no quotes or brackets reads
    the same wherever it lands."""
    return _PACKED + base64.b64encode(zlib.compress(source.encode(), 9)).decode("ascii")


@functools.lru_cache(maxsize=256)
def unpack(text: str) -> str:
    """The kernel source of ``pack``'s output (a source given as it is passes through)."""
    if not text.startswith(_PACKED):
        return text
    return zlib.decompress(base64.b64decode(text[len(_PACKED):])).decode()


_kernels, _kernels_lock = {}, threading.Lock()


def _kernel(source):
    """``(header, jitted kernel)`` of ``source``, loaded once per source from a file named by its hash
    (Triton reads a kernel's source through ``inspect``, which needs a file)."""
    found = _kernels.get(source)
    if found is not None:
        return found
    key = hashlib.sha256(source.encode()).hexdigest()[:32]
    with _kernels_lock:
        if source not in _kernels:
            folder = os.path.join(tempfile.gettempdir(), f"torch_scan_hop_triton_{os.getuid()}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"pointwise_scan_{key}.py")
            if not os.path.exists(path):
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(source)
                os.replace(tmp, path)  # atomic: another process may load it at the same time
            spec = importlib.util.spec_from_file_location(f"torch_scan_hop_pointwise_scan_{key}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _kernels[source] = triton_scan.read_header(source), getattr(module, triton_scan.KERNEL_NAME)
        return _kernels[source]


def _block(n, device):
    """(BLOCK, num_warps): enough programs to fill the GPU (2 per SM) with the time loop serial
    in each; a lane's loads are latency bound, so a few elements per thread hide some of it."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    block = min(256, max(32, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(n / (2 * sms))))))))
    return block, max(1, block // 64)


def _strides(init, xs, lifted):
    out = {}
    for k, c in enumerate(init):
        out.update({f"h{k}_in_s{d}": s for d, s in enumerate(c.stride())})
    for k, x in enumerate(xs):
        out.update({f"a{k}_s{d}": s for d, s in enumerate(x.stride()[1:])})
        out[f"a{k}_st"] = x.stride(0)
    for k, w in enumerate(lifted):
        out.update({f"w{k}_s{d}": s for d, s in enumerate(w.stride())})
    return out


def _steps(info, xs):
    """The number of steps: the xs' leading size (a SymInt under a fake run of a symbolic length)."""
    return xs[0].shape[0] if xs else info["T"]


def _outputs_like(info, init, xs, lifted):
    device = next(t.device for t in (*init, *xs, *lifted))
    carries = [torch.empty(c.shape, dtype=c.dtype, device=device) for c in info["carries"]]
    ys = [torch.empty((_steps(info, xs), *y.shape), dtype=y.dtype, device=device) for y in info["ys"]]
    return carries, ys


def _partials(info, outputs):
    """What the kernel writes for each output: the output itself, or for a sum over elements (a carry
    the body sums into, a y that is a sum) an E-shaped buffer of per-element partials (per step for
    a y) in the compute dtype (float32 for 16-bit floats)."""
    wide = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
    nc = len(info["carries"])
    return [torch.empty((*(() if k < nc else (o.shape[0],)), *info["E"]), dtype=wide.get(o.dtype, o.dtype),
                        device=o.device) if k in info["acc"] else o for k, o in enumerate(outputs)]


def _finish_sums(info, init, outputs, partials):
    """Each sum over elements: the partials summed over the dims they are summed along, at index 0
    along the dims whose lanes hold copies; a carry's added to its initial value. What is left has
    size 1 but along the output's own E dims, in E's order (the generator checks it), so a reshape
    gives the output, also a y smaller than E that does not broadcast to it (Mamba's (B, D))."""
    nc = len(info["carries"])
    for k, (summed, first) in info["acc"].items():
        part, lead = partials[k], 0 if k < nc else 1
        for j in first:
            part = part.narrow(j + lead, 0, 1)
        if summed:
            part = part.sum(dim=[j + lead for j in summed], keepdim=True)
        part = part.reshape(outputs[k].shape)
        if k < nc:
            torch.add(init[k], part, out=outputs[k])
        else:
            outputs[k].copy_(part)


@torch.library.custom_op("torch_scan_hop::pointwise_scan", mutates_args=())
def pointwise_scan(source: str, init: list[torch.Tensor], xs: list[torch.Tensor],
                   additional_inputs: list[torch.Tensor], reverse: bool) -> list[torch.Tensor]:
    """The scan ``source`` (from ``triton_scan.kernel_source``) computes, as one kernel launch.
    Carries and ys come back new and contiguous."""
    info, kernel = _kernel(unpack(source))
    carries, ys = _outputs_like(info, init, xs, additional_inputs)
    element, length = info["E"], _steps(info, xs)
    if any(c.shape != w.shape for c, w in zip(init, carries)) or any(x.shape[0] != length for x in xs) \
            or bool(info["reverse"]) != reverse or (len(xs), len(additional_inputs)) != (info["nx"], info["nl"]):
        raise ValueError("torch_scan_hop::pointwise_scan: the inputs do not match the kernel's signature")
    n = math.prod(element)
    device = carries[0].device if carries else ys[0].device
    block, warps = _block(n, device)
    partials = _partials(info, [*carries, *ys])
    args = [*init, *xs, *additional_inputs, *partials]
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(-(-n // block),)](*args, **_strides(init, xs, additional_inputs),
                                          N=n, T=length, BLOCK=block, num_warps=warps)
    _finish_sums(info, init, [*carries, *ys], partials)
    return [*carries, *ys]


@pointwise_scan.register_fake
def _(source, init, xs, additional_inputs, reverse):
    carries, ys = _outputs_like(triton_scan.read_header(unpack(source)), init, xs, additional_inputs)
    return [*carries, *ys]
