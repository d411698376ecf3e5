"""Saved carries read from the previous step: one stacked buffer fewer per carry.

A partitioned step often saves its carry input (a matmul's weight gradient
needs it) and also a value that the next carry is a pointwise function of (GELU
saves its input ``a``, tanh its output). Across steps these are the same data
shifted by one: the carry entering step i is ``g(a)`` of step i-1 (or the init
at the first step). Stacking both costs a second [length, ...] buffer, its
fill and a row write per step. This module finds such carries so that the
backward can rebuild row i as ``g(saved[i - 1])`` (``init`` at the first step)
from the stacks it reads anyway.

On XLA (CPU) a stacked buffer is memory traffic the loop does not have: the
buffer is filled before the While (XLA has no uninitialized buffer there), each
step writes a row, the backward copies it out for its dot. The ``g`` it adds is
one fused pass that replaces that copy. jax.lax.scan shows the same on a stack
of Linear + GELU layers: 8-10% per training step.

Used where it pays and is checked: the While lowering on XLA, SPMD included, for
rows of at least 1 KiB (``use_shift``, ``worth_it``); make_fx and inductor keep
every saved carry.
"""
import collections
import dataclasses
from typing import List

import torch

from .. import _compat

_MAX_NODES = 16  # a recipe is a short pointwise chain (an activation); anything longer stays saved


@dataclasses.dataclass
class Shift:
    """Saved value ``saved`` is carry ``carry``'s input; the carry output is
    ``recipe(*saved values at ``leaves``, *lifted inputs at ``lifted``)``."""

    saved: int
    carry: int
    leaves: List[int]
    lifted: List[int]
    recipe: torch.fx.GraphModule


def _cheap(node):
    """Pointwise or a view, nothing random; not ``as_strided``, whose result reads the storage
    layout of its input (a rebuilt value has its own)."""
    target = node.target
    if not _compat.is_op_overload(target) or "as_strided" in str(target):
        return False
    tags = target.tags
    return torch.Tag.nondeterministic_seeded not in tags and (
        torch.Tag.pointwise in tags or target.is_view)


def _recipe_nodes(out, leaf_of, lifted_of):
    """The nodes between the saved leaves / lifted inputs and ``out`` (a set in
    the walk's order; ``_build_recipe`` copies them in graph order), or None where
    ``out`` needs anything else (a carry, an x slice, a costly or random op)."""
    found, stack = {}, [out]
    while stack:
        node = stack.pop()
        if node in found or node in leaf_of or node in lifted_of:
            continue
        if node.op != "call_function" or not _cheap(node) or len(found) >= _MAX_NODES:
            return None
        found[node] = True
        stack.extend(n for n in node.all_input_nodes)
    return found


def _build_recipe(fwd, out, nodes, leaves, lifted):
    graph = torch.fx.Graph()
    env = {}
    for node in leaves + lifted:
        env[node] = graph.placeholder(f"in_{len(env)}")
    for node in fwd.graph.nodes:  # graph order is a topological order
        if node in nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[out])
    return _compat.tracing.lazy_graph_module(fwd, graph)


def find_shifts(fb) -> List[Shift]:
    """The saved carries of ``fb`` (a ``partition.FwdBwd``) that a recipe over
    the step's other saved values rebuilds from the previous step."""
    placeholders = list(fb.fwd.graph.find_nodes(op="placeholder"))
    (outs,) = fb.fwd.graph.find_nodes(op="output")[0].args
    num_out = fb.num_carry + fb.num_y
    saved_nodes = outs[num_out:]
    step_saved = {}
    for i, (node, (kind, _)) in enumerate(zip(saved_nodes, fb.saved_from)):
        if kind == "step":
            step_saved.setdefault(node, i)
    first_lifted = fb.num_carry + fb.num_x
    lifted_of = {placeholders[first_lifted + j]: j for j in range(fb.num_lifted)}
    shifts = []
    for i, (kind, k) in enumerate(fb.saved_from):
        out = outs[k] if kind == "carry" else None
        if out is None or out.op == "placeholder" or not isinstance(out.meta.get("val"), torch.Tensor):
            continue
        nodes = _recipe_nodes(out, step_saved, lifted_of)
        if nodes is None:
            continue
        inputs = {n for m in nodes for n in m.all_input_nodes} | {out}
        leaves = [n for n in step_saved if n in inputs]
        lifted = [n for n in lifted_of if n in inputs]
        shifts.append(Shift(i, k, [step_saved[n] for n in leaves], [lifted_of[n] for n in lifted],
                            _build_recipe(fb.fwd, out, nodes, leaves, lifted)))
    return shifts


_MIN_ROW_BYTES = 1024


def worth_it(carry):
    """A carry row of at least 1 KiB. Rebuilding costs a few small ops per step (the row's index,
    the select with the init) against a row write and its share of the fill: a tanh RNN on XLA CPU
    (training step, one core, per step) gained 5-8% at 2 KiB rows and 10-15% at 16 KiB, and moved
    -7%..+10% at 256 bytes."""
    if not isinstance(carry, torch.Tensor) or not isinstance(carry.numel(), int):
        return False  # (a symbolic size: no guard is added for this choice)
    return carry.numel() * carry.element_size() >= _MIN_ROW_BYTES


def use_shift(flat, unroll, length):
    """Rebuild shifted carries on this call? On XLA's While (SPMD included: the row is read
    along the unsharded step dim)."""
    if not isinstance(length, int) or length < 2 or unroll >= length:
        return False  # straight-line code (unroll >= length) has no stacked buffers to save
    return _compat.on_xla([t for t in flat if isinstance(t, torch.Tensor)])  # (flat may hold SymInts)


_MAX_ROWS = 64  # (length, reverse, device) keys kept
_rows = collections.OrderedDict()


def previous_rows(length, reverse, device):
    """Per step: the row its carry came from (clamped at the first step) and whether it
    is the first step (the carry is the init there).

    On XLA made once per (length, reverse, device), on the CPU, moved and then reused: made
    there per call, the arange, shift and compare took 0.23 ms of host time per backward (torch_xla
    2.9 builds an arange on the host element by element, ``core/step_index.py``), a tenth of the
    host time ``scan_layers`` added to a training step at depth 8 of benchmarks/xla_long.py, for
    values that never change. While a graph is traced they are made afresh, as
    ``layers.stack_weights._row_indices`` are: fake tensor mode refuses a cached real tensor, and
    a tensor made under a tracer must not be kept for a later call."""
    if torch.device(device).type != "xla" or _compat.dispatch_modes_active() \
            or _compat.functorch_transforms_active():
        return _previous_rows(length, reverse, device)
    key = (length, reverse, str(device))
    if key not in _rows:
        _rows[key] = tuple(t.to(device) for t in _previous_rows(length, reverse, "cpu"))
        if len(_rows) > _MAX_ROWS:
            _rows.popitem(last=False)
    _rows.move_to_end(key)
    return _rows[key]


def _previous_rows(length, reverse, device):
    index = torch.arange(length, device=device)
    prev = (index + 1).clamp(max=length - 1) if reverse else (index - 1).clamp(min=0)
    first = index == (length - 1 if reverse else 0)
    return prev, first


def rebuild_carries(graph, shifts, prev, first, stacks, inits, lifted):
    """Nodes in ``graph`` (the backward step's) computing each shifted carry input:
    ``where(first, init, recipe(stack[prev] for each leaf, *lifted))``.
    ``stacks``: saved index -> its stacked placeholder; ``lifted``: lifted index -> node."""
    aten = torch.ops.aten
    index = graph.call_function(aten.reshape.default, (prev, [1]))
    rows = {}
    values = {}
    for shift, init in zip(shifts, inits):
        for leaf in shift.leaves:
            if leaf not in rows:
                picked = graph.call_function(aten.index_select.default, (stacks[leaf], 0, index))
                rows[leaf] = graph.call_function(aten.squeeze.dim, (picked, 0))
        args = [rows[leaf] for leaf in shift.leaves] + [lifted[j] for j in shift.lifted]
        value = graph.graph_copy(shift.recipe.graph, dict(zip(shift.recipe.graph.find_nodes(op="placeholder"), args)))
        values[shift.saved] = graph.call_function(aten.where.self, (first, init, value))
    return values
