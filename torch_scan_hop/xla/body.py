"""The scan body as an HLO computation: run once on placeholder XLA tensors.

Placeholders have a shape but no buffer, so the body is staged out without
computing anything. Whatever reads a value on the host (``.item()``, an op
torch_xla runs through its CPU fallback) would abort the process on a
placeholder, and inside a While there is no per-step value to read anyway:
``check_runs_on_xla`` rejects those with a ScanError before the body runs.
Moves to the CPU are dropped instead (``keep_on_device``): values stay put.

Parameters of the body HLO come from four places: the carry, the x slice, the
additional inputs, and device data the body made itself (constants, hoisted
and passed to every call). If the body draws random numbers, XLA's RNG seed is
one more parameter, fed one seed per step (a length-T vector sliced like an x).
"""
import copy
import dataclasses
import operator
from typing import List

import torch

from .. import _compat
from ..core.op_args import example_args
from ..core.trees import ScanError
from ..trace.graph import trace_graph
from .conds import conds_as_selects
from .own_buffers import OwnBuffer
from .row_writes import defer_row_writes

CARRY, X, PASS = 0, 1, 2  # what feeds a body parameter (hlo_scan.cc's Kind)

_aten = torch.ops.aten
_HOST_READS = {
    _aten._local_scalar_dense.default: "reads a tensor's value on the host (.item(), float(t), int(t))",
    _aten.equal.default: "reads tensor values on the host (torch.equal)",
    _aten.is_nonzero.default: "reads a tensor's value on the host (bool(t), if t: ...)",
}
# Kernels that run on XLA without its CPU fallback. A CompositeExplicitAutogradNonFunctional
# kernel counts only if the op's out= variant has one of these (_linalg_solve_ex's has none).
_KERNEL_KEYS = ("XLA", "CompositeExplicitAutograd", "CompositeImplicitAutograd")


# Checks that read a value on the host to raise (a singular matrix in linalg.solve, an
# assert on a tensor): inside a While there is no per-step value to read, so they are
# dropped, as XLA itself does not raise (a singular solve gives inf/nan there).
_HOST_CHECKS = {op for op in (
    getattr(_aten, "_linalg_check_errors", None), getattr(_aten, "_assert_async", None),
    getattr(_aten, "_functional_assert_async", None)) if op is not None}


def _host_check(node):
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _HOST_CHECKS


def _to_host(node):
    """A copy to a non-XLA device (t.cpu(), t.to("cpu"))."""
    if node.op != "call_function":
        return False
    device = node.kwargs.get("device")
    return node.target is _aten._to_copy.default and device is not None and torch.device(device).type != "xla"


def _empty_dim_reduction(node):
    """Where the ``dim`` argument of a reduction over ``dim=()`` is (its index, or
    "dim"), which torch reads as every dim and torch_xla 2.9 as none (``t.amax()``,
    ``t.sum(())``, ``t.mean(())``, ``vector_norm(t, dim=())``: the input comes back
    unreduced, a silently wrong value); else None."""
    if node.op != "call_function" or not _compat.is_op_overload(node.target):
        return None
    arguments = _compat.op_schema(node.target).arguments
    names = [a.name for a in arguments]
    if "dim" not in names or "keepdim" not in names or "List[int]" not in str(arguments[names.index("dim")].type):
        return None
    index = names.index("dim")
    if len(node.args) > index:
        where, value = index, node.args[index]
    else:  # left at its default: amax's and amin's is ()
        where, value = "dim", node.kwargs.get("dim", arguments[index].default_value)
    return None if value is None or len(value) else where


class _OverEveryDim:
    """``op`` with its empty ``dim`` given every dim of the input it meets (a
    backward graph's inputs carry no metadata to read the rank from)."""

    def __init__(self, op, where):
        self.op, self.where = op, where
        self.__name__ = f"{op.__name__}_over_every_dim"

    def __call__(self, *args, **kwargs):
        every = list(range(args[0].dim()))
        if self.where == "dim":
            kwargs = {**kwargs, "dim": every}
        else:
            args = (*args[:self.where], every, *args[self.where + 1:])
        return self.op(*args, **kwargs)


def _has_kernel(qualified_name, keys=_KERNEL_KEYS):
    return any(_compat.has_kernel_for(qualified_name, k) for k in keys)


def _overload_name(op):
    schema = _compat.op_schema(op)
    return schema.name if not schema.overload_name else f"{schema.name}.{schema.overload_name}"


def _falls_back_to_cpu(op):
    """torch_xla has no lowering for op: its CPU fallback copies the inputs' values to the host."""
    name = _overload_name(op)
    if _has_kernel(name):
        return False
    if not _has_kernel(name, ("CompositeExplicitAutogradNonFunctional",)):
        return True
    packet = op.overloadpacket
    outs = [getattr(packet, o) for o in packet.overloads()]
    outs = [o for o in outs if any(a.is_out for a in _compat.op_schema(o).arguments)]
    return not any(_has_kernel(_overload_name(o)) for o in outs)


def _problem(node):
    op = node.target
    if op in _HOST_READS:
        return _HOST_READS[op] + ", which a step inside an XLA While cannot do; keep it a tensor " \
            "(x * c.sum() instead of x * c.sum().item(), torch.where instead of if)"
    if _falls_back_to_cpu(op):
        return "has no XLA lowering (torch_xla runs it on the CPU from the tensor's value), so it cannot run " \
            "inside an XLA While; rewrite that step with other ops, or run the scan on CPU"
    return None


def check_runs_on_xla(body):
    """Raise a ScanError for the first op of a body graph that needs values on the host."""
    if not isinstance(body, torch.fx.GraphModule):
        return  # a Python callable: nothing to inspect before running it
    for node in body.graph.nodes:
        if node.op != "call_function" or not _compat.is_op_overload(node.target):
            continue
        problem = _problem(node)
        if problem is not None:
            raise ScanError(f"scan on XLA: the body's {node.target} ({node.name}) {problem}.")


def _annotate_sharding(tensor, mesh, partition_spec):
    """What ``xla::aot_mark_sharding(tensor, mesh, partition_spec)`` stages
    out, safe on a lowering placeholder: a copy of ``tensor`` under a Sharding
    custom call. torch_xla 2.9: the op calls ``mark_sharding``, which annotates
    a computed value this way (``custom_sharding_``) but, when the value is
    device data, reads it to the host to upload it sharded, and a placeholder
    has no buffer to read (a segfault). ``annotate_custom_sharding`` (public)
    always takes the custom-call path."""
    import ast

    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh.from_str(mesh)
    out = xs.annotate_custom_sharding(tensor.clone(), mesh, ast.literal_eval(partition_spec))
    return getattr(out, "global_tensor", out)


def _sharding(node):
    """An ``xla::aot_mark_sharding`` node (``mark_sharding_with_gradients`` and its gradient)."""
    return node.op == "call_function" and _compat.is_op_overload(node.target) \
        and _compat.op_schema(node.target).name == "xla::aot_mark_sharding"


def keep_on_device(body):
    """``body`` ready to run on placeholders (a copy; body is not changed):
    its moves to the CPU and its host-side checks dropped, its sharding
    annotations staged out as custom calls, its reductions over ``dim=()``
    given every dim (``_empty_dim_reduction``).

    Inside the While every value lives on the device, and a copy keeps the
    value. Graphs have such moves where a 0-dim CPU tensor meets XLA ones, as
    in the gradient of a CPU scalar closure (autograd moves it back after).
    ``xla::aot_mark_sharding`` of a body input (a carry whose annotation is
    the first op, the carry's gradient when no y feeds it) would make
    torch_xla read the placeholder's value: ``_annotate_sharding``
    stages out the same annotation without reading it.
    """
    if not isinstance(body, torch.fx.GraphModule) or not any(
            _to_host(n) or _host_check(n) or _sharding(n) or _empty_dim_reduction(n) is not None for n in body.graph.nodes):
        return body
    gm = torch.fx.GraphModule(body, copy.deepcopy(body.graph))
    for node in list(gm.graph.nodes):
        if _to_host(node):
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}
        elif _host_check(node) and not node.users:
            gm.graph.erase_node(node)
        elif _sharding(node):
            node.target = _annotate_sharding
        elif (where := _empty_dim_reduction(node)) is not None:
            node.target = _OverEveryDim(node.target, where)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


@dataclasses.dataclass
class BodyHlo:
    """One step of the body as HLO, and what feeds each of its parameters."""

    proto: bytes  # HloModuleProto
    params: List[tuple]  # body parameter i <- (CARRY | X | PASS, index)
    y_meta: List[tuple]  # (per-step shape, dtype) of each y
    hoisted: List[OwnBuffer]  # device data the body made, appended to the pass-through inputs
    uses_seed: bool  # the last x is the per-step RNG seed vector
    y_carry: List[int]  # per y: the carry it is (the step's carry input, unchanged), or -1
    carry_rows: List[int]  # per carry: the dim whose rows the While writes (row_writes), or -1
    row_carries: List[int]  # per row the While writes per step, in the body's order: its carry


def _xla():
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_model  # noqa: F401

    return torch_xla, xb


def _placeholders(xb, tensors, drop_lead=False):
    return [xb.create_placeholder_tensor(tuple(t.shape[1:] if drop_lead else t.shape), t.dtype) for t in tensors]


def _run_on_placeholders(combine_fn, init, xs, additional_inputs):
    """(placeholder groups, outputs). Functionalization must be on here: the
    Functionalize rule excluded its key, and without it torch_xla builds
    placeholders without the functional wrapper and lowers chains of views
    (permute then view, as einsum emits them) to the wrong HLO."""
    torch_xla, xb = _xla()
    rng_state = torch_xla.core.xla_model.get_rng_state()
    try:
        with torch.no_grad(), _compat.functionalization_on():
            groups = [(CARRY, _placeholders(xb, init)), (X, _placeholders(xb, xs, drop_lead=True)),
                      (PASS, _placeholders(xb, additional_inputs))]
            outs = list(combine_fn(*(t for _, ts in groups for t in ts)))
    finally:  # tracing drew from the RNG; a cached call would not, so undo that draw
        torch_xla.core.xla_model.set_rng_state(rng_state)
    return groups, outs


def _param_sources(ctx, groups, outs, num_x, num_pass):
    """body parameter -> (kind, index), and the hoisted device data; the seed is the x after the real ones."""
    where = {}
    for kind, tensors in groups:
        for i, t in enumerate(tensors):
            pid = ctx.tensor_parameter_id(t)
            if pid != -1:
                where[pid] = (kind, i)
    ids, values = _compat.xla.device_data_nodes(outs)
    seed_pid = None
    if _compat.xla.seed_info_id() in ids:
        seed_pid = ctx.tensor_parameter_id(values[ids.index(_compat.xla.seed_info_id())])
    hoisted = []
    device_data = ctx.device_parameter_id_tensor_mapping()
    for pid in sorted(device_data):
        if pid in where:
            continue
        if pid == seed_pid:
            where[pid] = (X, num_x)
            continue
        where[pid] = (PASS, num_pass + len(hoisted))
        hoisted.append(OwnBuffer(device_data[pid]))  # see own_buffers
    missing = sorted(set(range(len(where))) - set(where))
    if missing:
        raise ScanError(f"scan on XLA: body HLO parameters {missing} have no known source (internal error).")
    return [where[pid] for pid in range(len(where))], hoisted, seed_pid is not None


def _is_aten_graph(gm):
    return all(n.op in ("placeholder", "output", "get_attr") or (
        n.op == "call_function" and (_compat.is_op_overload(n.target) or n.target is operator.getitem))
        for n in gm.graph.nodes)


def as_aten_graph(body, init, xs, additional_inputs):
    """A graph body of torch-level calls (Dynamo's) traced to aten ops, which
    ``check_runs_on_xla`` can read; other bodies as they are."""
    if not isinstance(body, torch.fx.GraphModule) or _is_aten_graph(body):
        return body
    with torch.no_grad(), _compat.disable_proxy_modes_tracing():
        examples = example_args(init, xs, additional_inputs)
    return trace_graph(body, examples)


def lower_body(combine_fn, init, xs, additional_inputs):
    """Stage out one step of ``combine_fn`` as HLO (nothing runs on the device); None for a
    step with no output at all."""
    combine_fn = conds_as_selects(as_aten_graph(combine_fn, init, xs, additional_inputs))
    check_runs_on_xla(combine_fn)
    inputs = [(t.shape, t.dtype) for t in init] + [(x.shape[1:], x.dtype) for x in xs] \
        + [(a.shape, a.dtype) for a in additional_inputs]
    rows = defer_row_writes(keep_on_device(combine_fn), len(init), inputs)
    groups, outs = _run_on_placeholders(rows.body, init, xs, additional_inputs)
    if not outs:
        return None  # no carry and no y (every leaf None): XLA has no computation to build
    ctx = _compat.xla.lowering_context("scan_body")
    ctx.build(outs)
    params, hoisted, uses_seed = _param_sources(ctx, groups, outs, len(xs), len(additional_inputs))
    ys = outs[len(init):len(outs) - 2 * len(rows.writes)]
    carry_rows = [-1] * len(init)
    for k, dim in rows.writes:
        carry_rows[k] = dim
    return BodyHlo(ctx.hlo(), params, [(tuple(y.shape), y.dtype) for y in ys], hoisted, uses_seed,
                   [_carry_of(ctx, y, params, carry_rows) for y in ys], carry_rows, [k for k, _ in rows.writes])


def _carry_of(ctx, y, params, carry_rows):
    """The carry index ``y`` is a parameter of (a saved step input), else -1. The While writes such a
    y from the step's carry output into the next step's row, but a carry whose rows it writes
    (``carry_rows``) holds the step's row pending there: that y stays a y (fuzz seed 24004, a
    recomputed step read its buffer without the row the step before wrote)."""
    pid = ctx.tensor_parameter_id(y)
    if pid == -1 or params[pid][0] != CARRY or carry_rows[params[pid][1]] != -1:
        return -1
    return params[pid][1]

