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
runs its own kind's code, as in the loop (on XLA both branches and a select: ``xla.conds``).

Only where a step hands out nothing but the hidden state (no cache rows, module state, capture
hooks, FSDP2 / DTensor weights), traced (XLA included), and not straight-line: elsewhere ``None``
and the caller runs the pattern's plan.
"""
import torch

from .. import _compat
from ..api import scan
from ..core import dtensors as dt, route, schedule
from ..core.trees import ScanError
from . import module_state, one_code, trace_time, written_rows
from .blocks import hidden_of
from .checks import check_no_hooks, check_no_hooks_traced, check_no_running_stat_updates
from .fsdp import check_fsdp
from .layer_kwargs import split as split_kwargs
from .layer_state import layer_states
from .stack_weights import stack_state
from .view import LABELS, view_of

_COND = torch.ops.higher_order.cond


def scan_alike(layers, kinds, hidden, per_layer, remat, unroll):
    """The stack as one scan choosing each layer's code by kind, or None where it does not apply
    (then nothing was run). ``unroll``: resolved (``scan_layers._resolve_unroll``)."""
    states = layer_states(layers)
    tensors = [t for t in states[0].values()] + [hidden]
    if (route.runs_the_loop(tensors, remat)
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
    stack = _Kinds(layers, kinds)
    xs = stack_state(states, False)
    kind_rows = torch.tensor(kinds, device=hidden.device)
    distinct = [] if varying is None else varying.distinct()  # Gemma 3's masks: two, not one per layer
    stacks, rows = [values for values, _ in distinct], [index for _, index in distinct]

    def kwargs_at(step_rows):
        return shared if varying is None else varying.rebuild([values[r] for values, r in zip(stacks, step_rows)])

    excused = _one_code(layers, kinds, lambda: (hidden, states[0], per_layer[0], kind_rows[0]))  # layer 0's step

    def step(h, x):
        params, step_rows, kind = x
        ops, layout = _operands(h, params, kwargs_at(step_rows), kind)
        if excused is not None:
            return stack.branch(0, layout, excused)(*ops)[0], None
        return _chain(ops[0], [stack.branch(k, layout) for k in range(stack.count)], ops)[0], None

    out, _ = scan(step, hidden, (xs, rows, kind_rows), remat=remat, unroll=unroll)
    return out


def one_code_excused(layers, kinds, hidden, params, kwargs, kind):
    """Where every kind's code traces to one graph on one step's operands (``one_code``), the
    attribute paths that tell the kinds apart (excused from the check on read), sorted; else
    None. Run outside any trace, or by Dynamo's tracker at trace time on fakes (``trace_time``)."""
    stack = _Kinds(layers, kinds)
    ops, layout = _operands(hidden, params, kwargs, kind)
    plain = [v for v in layout[0] if not isinstance(v, torch.Tensor)]
    if not one_code.traces_alike(layers, kinds, [stack.branch(k, layout) for k in range(stack.count)], ops, plain):
        return None
    return tuple(sorted(one_code.excused_paths(layers, kinds)))


def _one_code(layers, kinds, first_step):
    """``one_code_excused`` told before the scan: outside any trace directly, under Dynamo by its
    tracker at trace time (so Dynamo never speculates the cond); under make_fx and the like
    None (the cond runs)."""
    if one_code.may_decide():
        return one_code_excused(layers, kinds, *first_step())
    if _compat.is_dynamo_compiling() and trace_time.installed():
        return trace_time.ask(one_code_excused, None, layers, tuple(kinds), *first_step())
    return None


class _Kinds:
    """A stack's kinds: each kind's first layer (whose code its branch runs), the others of
    its kind (checked on read against it) and their labels."""

    def __init__(self, layers, kinds):
        members = [[i for i, k in enumerate(kinds) if k == kind] for kind in range(max(kinds) + 1)]
        self.layers, self.count = layers, len(members)
        self.reps = [m[0] for m in members]
        self.peers = [[layers[i] for i in m[1:]] for m in members]
        self.labels = [[f"layer {i}" for i in m] for m in members]

    def branch(self, k, layout, excused=None):
        """Kind k's code on the cond's operands; with ``excused`` (``one_code``), layer 0's code
        for every layer, checked on read against all of them but for the excused attributes."""
        leaves, spec, where, slots = layout
        rep, layers = self.layers[self.reps[k]], self.layers
        peers = self.peers[k] if excused is None else layers[1:]  # reps[0] is layer 0

        def run(kind, *tensors):
            full = list(leaves)
            for i, j in zip(where, slots):
                full[i] = tensors[j]
            p, kw = _compat.pytree.tree_unflatten(full, spec)
            # the view records what it checked in ``checked``: made here, inside the branch (Dynamo
            # refuses a cond branch that changes a dict from outside it)
            checked = ({LABELS: self.labels[k]} if excused is None else
                       {LABELS: [f"layer {i}" for i in range(len(layers))], **dict.fromkeys(excused, True)})
            view = view_of(rep, p, peers=peers, checked=checked)
            return (hidden_of(view(tensors[0], **kw), self.reps[k]),)
        return run


def _operands(h, params, kwargs, kind):
    """(the cond's operands: kind, h and each tensor once, the layout to rebuild the rest)."""
    leaves, spec = _compat.pytree.tree_flatten((params, kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    unique, slots = [h], []  # each tensor once: Dynamo's cond (2.9) names a repeated operand twice
    for i in where:
        j = next((j for j, u in enumerate(unique) if u is leaves[i]), None)
        if j is None:
            j = len(unique)
            unique.append(leaves[i])
        slots.append(j)
    return (kind, *unique), (leaves, spec, where, slots)


def _chain(kind, branches, operands, first=0):
    """``branches[kind - first](*operands)`` as conds: kind == first, else the rest. The op itself,
    not ``torch.cond``: outside Dynamo that compiles its call (through the closures' stand-ins of a
    make_fx trace, which it cannot); under Dynamo the two are one. Its branches return tuples."""
    if len(branches) == 1:
        return branches[0](*operands)
    rest = lambda *ops: _chain(ops[0], branches[1:], ops, first + 1)  # noqa: E731
    return tuple(_COND(kind == first, branches[0], rest, operands))

