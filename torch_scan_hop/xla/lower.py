"""Lowering a scan on XLA tensors to XLA ``While`` loops (see csrc/hlo_scan.cc).

``body.lower_body`` stages one step of the body out as HLO; the C++
extension wraps it in one While per segment of the loop schedule
(``schedule.segments``: the unrolled blocks, then the remainder), whose body
calls the step ``unroll`` times per iteration. The result is cached per (body
object, input shapes, reverse, unroll): a second call with the same shapes does
not run the body in Python again.
"""
import dataclasses
from typing import Any, List

import torch

from .. import _compat
from ..core import schedule
from ..core.trees import ScanError
from ..trace import cache
from . import kept_ys
from .body import lower_body
from .own_buffers import OwnBuffer

# xla_data.proto PrimitiveType
_ETYPE = {
    torch.bool: 1, torch.int8: 2, torch.int16: 3, torch.int32: 4, torch.int64: 5, torch.uint8: 6,
    torch.float16: 10, torch.float32: 11, torch.float64: 12, torch.complex64: 15, torch.bfloat16: 16,
    torch.complex128: 18,
}


def _shape(dtype, dims):
    if dtype not in _ETYPE:
        raise ScanError(f"scan on XLA: dtype {dtype} is not supported by the While lowering.")
    return (_ETYPE[dtype], tuple(int(d) for d in dims))


@dataclasses.dataclass
class LoweredScan:
    """A compiled-once While computation and how to feed it."""

    computation: Any
    y_meta: List[tuple]  # (per-step shape, dtype) of each y
    hoisted: List[OwnBuffer]  # device data the body created (constants), passed each call
    uses_seed: bool
    takes_ys: bool = True  # False straight-line (csrc/hlo_straight.h): each y is made whole


def _hlo_scan():
    from .. import _hlo_scan

    return _hlo_scan


def _lower(combine_fn, init, xs, additional_inputs, reverse, unroll):
    body = lower_body(combine_fn, init, xs, additional_inputs)
    if body is None:  # nothing to return: the loop's steps have no visible effect
        return LoweredScan(None, [], [], False)
    length = int(xs[0].shape[0])
    xs_shapes = [_shape(x.dtype, x.shape) for x in xs]
    if body.uses_seed:
        xs_shapes.append(_shape(torch.int64, (length,)))
    segments = [(s.start, s.stop, s.unroll) for s in schedule.segments(length, unroll, reverse)]
    module = _hlo_scan().build_scan_module(
        body.proto, length, reverse, segments,
        [_shape(c.dtype, c.shape) for c in init], xs_shapes,
        [_shape(dtype, (length, *shape)) for shape, dtype in body.y_meta],
        [_shape(a.dtype, a.shape) for a in [*additional_inputs, *body.hoisted]], body.params,
        body.y_carry, body.carry_rows, body.row_carries)
    computation = _compat.xla.computation_from_module_proto("scan", module)
    straight = schedule.one_iteration(length, unroll)  # csrc/hlo_straight.h: no ys parameters
    return LoweredScan(computation, body.y_meta, body.hoisted, body.uses_seed, takes_ys=not straight)


def lowered_scan(combine_fn, init, xs, additional_inputs, reverse, unroll):
    """The LoweredScan for these inputs, from the cache when the body and shapes match."""
    key = ("xla", cache.tensor_meta([*init, *xs, *additional_inputs]), reverse, unroll)
    build = lambda: _lower(combine_fn, init, xs, additional_inputs, reverse, unroll)  # noqa: E731
    return cache.by_graph(combine_fn, key, build)  # a graph: closures are explicit inputs


def xla_device(tensors):
    return next(t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla")


def on_device(tensors, device):
    """The While's inputs all live on the XLA device. torch_xla moves CPU
    operands of an op there itself, so a Python loop over mixed inputs works;
    the While is one op with many operands and needs it done up front."""
    return [t if t.device == device else t.to(device) for t in tensors]


def _fill(k, dtype):
    """What the While's k-th ys buffer starts as: any value, as every row is written before
    the While returns, but not one value for all. XLA merges equal broadcasts (two
    zero-filled [length, ...] buffers become one), then copies the merged one for each other
    While-state buffer: a read and a write of a whole stacked buffer per scan (32 MB for
    a layer stack's saved activations at depth 32 of benchmarks/xla_long.py)."""
    return k % 2 if dtype is torch.bool else k


def scan_on_xla(combine_fn, init, xs, additional_inputs, reverse, unroll):
    """Run the While; returns [*final_carry, *ys]."""
    device = xla_device([*init, *xs, *additional_inputs])
    init, xs, additional_inputs = (on_device(group, device) for group in (init, xs, additional_inputs))
    lowered = lowered_scan(combine_fn, init, xs, tuple(additional_inputs), reverse, unroll)
    if lowered.computation is None:
        return []  # a body with no carry and no y (every leaf None) returns nothing
    length = xs[0].shape[0]
    seeds = []
    if lowered.uses_seed:
        seeds = [torch.randint(0, 2**62, (length,), dtype=torch.int64, device=device)]
    ys, kept = kept_ys.initial_ys(lowered.y_meta, length, device, _fill) if lowered.takes_ys else ([], [])
    inputs = [*init, *xs, *seeds, *ys, *additional_inputs,
              *on_device([h.value() for h in lowered.hoisted], device)]
    out = list(_compat.xla.user_computation("xla::scan", inputs, lowered.computation))
    kept_ys.keep_final(kept, out[len(init):])
    return out
