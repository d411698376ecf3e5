"""Layers of several kinds that may trace alike: one scan over them all, each step's code chosen
by the layer's kind with ``torch.cond``.

A patterned stack's kinds (``layers.patterns``) are told apart by every plain attribute, as
they must be: an attribute may select code. But many select nothing in the traced code: Gemma 3's
sliding and full attention layers differ in ``sliding_window`` (an int or None) and
``is_sliding``, which under sdpa or eager attention turn into no op (the window is in the mask
the model hands each layer). Scanned by pattern, Gemma 3 at 16 layers traces and compiles a
sliding and a full layer, and at 4 layers (all sliding) one: the first compiled step at 16 was
~2.4x the one at 4. Here the stack is ONE scan over all its layers when their weights have one
signature; the step runs ``cond(kind == 0, layer of kind 0, layer of kind 1)`` on the same
operands (hidden state, the step's weights, its keyword tensors), each branch through the view
of a layer of its kind, checked on read against every layer of that kind. Dynamo's tracker then
replaces a cond whose branches traced to one graph by that graph (``trace.same_branches``):
the body is one layer, whatever the depth. Branches that differ keep the cond, and each layer
runs its own kind's code, as in the loop.

Only where a step hands out nothing but the hidden state (no cache rows, module state, capture
hooks, FSDP2 / DTensor weights), traced, off XLA, and not straight-line: elsewhere ``None`` and
the caller runs the pattern's plan.
"""
import torch

from .. import _compat
from ..api import scan
from ..core import dtensors as dt, route, schedule
from ..core.trees import ScanError
from . import module_state, written_rows
from .blocks import hidden_of
from .checks import check_no_hooks, check_no_hooks_traced, check_no_running_stat_updates
from .fsdp import check_fsdp
from .layer_kwargs import split as split_kwargs
from .layer_state import layer_states
from .stack_weights import stack_state
from .view import LABELS, view_of


def scan_alike(layers, kinds, hidden, per_layer, remat, unroll):
    """The stack as one scan choosing each layer's code by kind, or None where it does not apply
    (then nothing was run). ``unroll``: resolved (``scan_layers._resolve_unroll``)."""
    states = layer_states(layers)
    tensors = [t for t in states[0].values()] + [hidden]
    if (route.runs_the_loop(tensors, remat) or any(t.device.type == "xla" for t in tensors)
            or any(dt.is_dtensor(t) for t in tensors) or check_fsdp(layers[0]) is not None
            or schedule.one_iteration(len(layers), unroll)):
        return None
    try:
        per_layer, slots = written_rows.as_rows(per_layer)
        if any(slots) or module_state.rows(layers[0], layers):
            return None
        check_no_running_stat_updates(layers[0])
        shared, varying = split_kwargs(per_layer, lambda i: f"layer {i}")
        collected = check_no_hooks_traced(layers, None) if _compat.is_dynamo_compiling() else check_no_hooks(layers)
    except ScanError:
        return None  # the pattern's plan runs, and raises what applies to it
    if collected:
        return None
    members = [[i for i, k in enumerate(kinds) if k == kind] for kind in range(max(kinds) + 1)]
    reps = [m[0] for m in members]
    peers = [[layers[i] for i in m[1:]] for m in members]
    labels = [[f"layer {i}" for i in m] for m in members]
    xs = stack_state(states, False)
    kind_rows = torch.tensor(kinds, device=hidden.device)
    distinct = [] if varying is None else varying.distinct()  # Gemma 3's masks: two, not one per layer
    stacks = [values for values, _ in distinct]

    def step(h, x):
        params, rows, kind = x
        kwargs = shared if varying is None else varying.rebuild([values[r] for values, r in zip(stacks, rows)])
        leaves, spec = _compat.pytree.tree_flatten((params, kwargs))
        where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        unique, slots = [h], []  # each tensor once: Dynamo's cond (2.9) names a repeated operand twice
        for i in where:
            j = next((j for j, u in enumerate(unique) if u is leaves[i]), None)
            if j is None:
                j = len(unique)
                unique.append(leaves[i])
            slots.append(j)

        def branch(k):
            def run(kind, *tensors):
                full = list(leaves)
                for i, j in zip(where, slots):
                    full[i] = tensors[j]
                p, kw = _compat.pytree.tree_unflatten(full, spec)
                view = view_of(layers[reps[k]], p, peers=peers[k], checked={LABELS: labels[k]})
                return hidden_of(view(tensors[0], **kw), reps[k])
            return run

        operands = (kind, *unique)
        return _chain(kind, [branch(k) for k in range(len(reps))], operands), None

    rows = [index for _, index in distinct]
    out, _ = scan(step, hidden, (xs, rows, kind_rows), remat=remat, unroll=unroll)
    return out


def _chain(kind, branches, operands, first=0):
    """``branches[kind - first](*operands)`` as conds: kind == first, else the rest."""
    if len(branches) == 1:
        return branches[0](*operands)
    rest = lambda *ops: _chain(ops[0], branches[1:], ops, first + 1)  # noqa: E731
    return torch.cond(kind == first, branches[0], rest, operands)

