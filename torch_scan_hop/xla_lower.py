"""Lowering a scan on XLA tensors to XLA ``While`` loops (see csrc/hlo_scan.cc).

``_lower`` runs the body once on placeholder XLA tensors (one carry, one x
slice, the additional inputs), lowers that to an HloModuleProto with torch_xla's
LoweringContext, and lets the C++ extension wrap it in one While per segment of
the loop schedule (``_schedule.segments``: the unrolled blocks, then the
remainder), whose body calls it ``unroll`` times per iteration. The result is
cached per (body object, input shapes, reverse, unroll): a second call with
the same shapes does not run the body in Python again.

Parameters of the body HLO come from four places: the carry, the x slice, the
additional inputs, and device data the body created itself (constants). If the
body draws random numbers, XLA's RNG seed is one more parameter; it is fed a
fresh seed per step (a length-T vector sliced like an x), so each step draws
different values and the same torch_xla seed reproduces them.
"""
import dataclasses
from typing import Any, List

import torch

from . import _cache, _compat, _schedule

# xla_data.proto PrimitiveType
_ETYPE = {
    torch.bool: 1, torch.int8: 2, torch.int16: 3, torch.int32: 4, torch.int64: 5, torch.uint8: 6,
    torch.float16: 10, torch.float32: 11, torch.float64: 12, torch.complex64: 15, torch.bfloat16: 16,
    torch.complex128: 18,
}
_CARRY, _X, _PASS = 0, 1, 2


def _xla():
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_model  # noqa: F401

    return torch_xla, xb


def _shape(dtype, dims):
    if dtype not in _ETYPE:
        raise TypeError(f"scan on XLA: dtype {dtype} is not supported in the While lowering")
    return (_ETYPE[dtype], tuple(int(d) for d in dims))


@dataclasses.dataclass
class LoweredScan:
    """A compiled-once While computation and how to feed it."""

    computation: Any
    y_meta: List[tuple]  # (per-step shape, dtype) of each y
    hoisted: List[torch.Tensor]  # device data the body created (constants), passed each call
    uses_seed: bool


def _placeholder(xb, shape, dtype):
    return xb.create_placeholder_tensor(tuple(shape), dtype)


def _body_params(ctx, groups):
    """body parameter number -> (kind, index) for the C++ builder."""
    where = {}
    for kind, tensors in groups:
        for i, t in enumerate(tensors):
            pid = ctx.tensor_parameter_id(t)
            if pid != -1:
                where[pid] = (kind, i)
    return where


def _lower(combine_fn, init, xs, additional_inputs, reverse, unroll):
    torch_xla, xb = _xla()
    X = torch_xla._XLAC
    length = int(xs[0].shape[0])
    rng_state = torch_xla.core.xla_model.get_rng_state()
    # Functionalization must be on: the Functionalize rule excluded its key, and
    # without it torch_xla makes placeholders without the functional wrapper
    # and lowers chains of views (permute then view, as einsum emits) wrongly.
    with torch.no_grad(), _compat.functionalization_on():
        ph_carry = [_placeholder(xb, c.shape, c.dtype) for c in init]
        ph_x = [_placeholder(xb, x.shape[1:], x.dtype) for x in xs]
        ph_add = [_placeholder(xb, a.shape, a.dtype) for a in additional_inputs]
        outs = list(combine_fn(*ph_carry, *ph_x, *ph_add))
    # Tracing drew from the RNG; a cached call would not, so undo that draw.
    torch_xla.core.xla_model.set_rng_state(rng_state)
    nc = len(init)
    ys = outs[nc:]
    ctx = X.lowering.LoweringContext("scan_body")
    ctx.build(outs)
    where = _body_params(ctx, [(_CARRY, ph_carry), (_X, ph_x), (_PASS, ph_add)])
    device_data = ctx.device_parameter_id_tensor_mapping()
    ids, values = X._get_tensors_xla_device_data_node(outs)
    seed_pid = None
    if X._get_seed_info_id() in ids:
        seed_pid = ctx.tensor_parameter_id(values[ids.index(X._get_seed_info_id())])
    hoisted = []
    for pid in sorted(device_data):
        if pid in where:
            continue
        if pid == seed_pid:
            where[pid] = (_X, len(xs))  # the per-step seed vector, appended to xs
            continue
        where[pid] = (_PASS, len(additional_inputs) + len(hoisted))
        hoisted.append(device_data[pid])
    params = [where[pid] for pid in range(len(where))]
    xs_shapes = [_shape(x.dtype, x.shape) for x in xs]
    if seed_pid is not None:
        xs_shapes.append(_shape(torch.int64, (length,)))
    segments = [(s.start, s.stop, s.unroll) for s in _schedule.segments(length, unroll, reverse)]
    module = _hlo_scan().build_scan_module(
        ctx.hlo(), length, reverse, segments,
        [_shape(c.dtype, c.shape) for c in init], xs_shapes,
        [_shape(y.dtype, (length, *y.shape)) for y in ys],
        [_shape(a.dtype, a.shape) for a in [*additional_inputs, *hoisted]], params)
    computation = X._xla_op_computation_from_module_proto("scan", module)
    return LoweredScan(computation, [(tuple(y.shape), y.dtype) for y in ys], hoisted, seed_pid is not None)


def _hlo_scan():
    from . import _hlo_scan

    return _hlo_scan


def lowered_scan(combine_fn, init, xs, additional_inputs, reverse, unroll):
    """The LoweredScan for these inputs, from the cache when the body and shapes match."""
    key = ("xla", _cache.tensor_meta([*init, *xs, *additional_inputs]), reverse, unroll)
    build = lambda: _lower(combine_fn, init, xs, additional_inputs, reverse, unroll)  # noqa: E731
    if isinstance(combine_fn, torch.fx.GraphModule):  # a graph: closures are explicit inputs
        return _cache.memo(combine_fn, key, build)
    return build()


def scan_on_xla(combine_fn, init, xs, additional_inputs, reverse, unroll):
    """Run the While; returns [*final_carry, *ys]."""
    torch_xla, _ = _xla()
    lowered = lowered_scan(combine_fn, init, xs, additional_inputs, reverse, unroll)
    length, device = xs[0].shape[0], xs[0].device
    seeds = []
    if lowered.uses_seed:
        seeds = [torch.randint(0, 2**62, (length,), dtype=torch.int64, device=device)]
    ys = [torch.zeros((length, *shape), dtype=dtype, device=device) for shape, dtype in lowered.y_meta]
    inputs = [*init, *xs, *seeds, *ys, *additional_inputs, *lowered.hoisted]
    return list(torch_xla._XLAC._xla_user_computation("xla::scan", inputs, lowered.computation))
