"""The joint graph of one step (its outputs and input gradients), traced from
the body as the user wrote it.

A body graph traced for inference has lost what only autograd sees:
``no_grad`` regions, ``detach``, a custom ``autograd.Function``'s backward.
So when the body came from ``scan``'s front end, the joint is traced from the
user's own function (``lift.source_of``): it reads its closed-over tensors
itself, autograd differentiates with respect to them where they are, and
their constants in the traced joint are then rebound to the lifted inputs.
Graph bodies (Dynamo's, which keep grad-mode switches and autograd.Function
as nodes) are differentiated as they are.

Which carries are differentiable is inferred as jax does: a carry requires
grad if init does, or if the body makes it depend on something that does,
iterated to a fixed point over the body.
"""
import contextlib
import warnings
from dataclasses import dataclass

import torch

from .. import _compat
from .closures import recording_functional_closures
from .flag_reach import FlagWatch, reach_or_none
from .graph import forget_constants, trace_graph
from .lift import source_of
from .xla_formulas import functions_as_ops


@contextlib.contextmanager
def stepping(combine_fn, primals, watch=None):
    """Runs one step on ``primals`` (*carry, *x, *lifted); yields
    ``(outputs, wrt, outer)`` with the closures' stand-ins active. ``watch``: a mode active
    while the body itself runs (above the stand-ins' mode, which it then does not see).

    ``wrt[i]`` lists the tensors autograd may reach for input i: the primal
    itself, or for a lifted closure what the body read in its place (its
    stand-in) and the closure itself (a custom autograd.Function receives it
    as an argument, untouched by stand-ins). ``outer`` maps a traced
    stand-in back to the user's tensor (``closures.recording_functional_closures``).
    """
    src = source_of(combine_fn)
    watch = contextlib.nullcontext() if watch is None else watch
    if src is None:
        with watch:
            outs = list(combine_fn(*primals))
        yield outs, [[p] for p in primals], lambda t: t
        return
    n = len(primals) - len(src.lifted)
    with recording_functional_closures(primals) as closures:
        with watch:
            outs = list(src.body(*primals[:n]))
        reached = [_reached(closures.inner(t), t) for t in src.lifted]
        yield outs, [*([p] for p in primals[:n]), *reached], closures.outer


def _reached(stand_in, t):
    """A closure's stand-in and, on the same device, the closure itself."""
    if stand_in is None or stand_in is t:
        return [t]
    return [stand_in, t] if stand_in.device == t.device else [stand_in]


def _differentiable(t):
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def with_flags(examples, flags):
    with _compat.disable_proxy_modes_tracing():
        return [e.detach().requires_grad_(bool(f)) if isinstance(e, torch.Tensor) else e
                for e, f in zip(examples, flags)]


def _outputs_require_grad(combine_fn, examples, flags):
    """One trace of the step (thrown away) with inputs requiring grad as
    flagged: autograd itself says which outputs require grad. A trace rather
    than a bare fake run, so the body reads its closures as the other traces do."""
    found = []

    def run(*primals):
        with stepping(combine_fn, primals) as (outs, _, _):
            found[:] = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
        return []

    with functions_as_ops():
        forget_constants(trace_graph(run, with_flags(examples, flags), force_enable_grad=True))
    return found


_MAX_ORBIT = 64  # carry-flag states followed for the loop's own flags (one body trace each)


@dataclass(frozen=True)
class FlagOrbit:
    """The loop's output requires_grad flags step by step: ``steps[k]`` after
    step k + 1, repeating from ``cycle_start`` (the carries' flags follow a
    finite orbit; a carry may stop requiring grad when the body overwrites it)."""

    steps: tuple
    cycle_start: int
    num_carry: int

    def after(self, length):
        """Flags of (*final carry, *stacked ys) after ``length`` >= 1 steps."""
        n, nc = len(self.steps), self.num_carry
        k = length - 1 if length <= n else self.cycle_start + (length - 1 - self.cycle_start) % (n - self.cycle_start)
        ys = [any(step[nc + j] for step in self.steps[:length]) for j in range(len(self.steps[0]) - nc)]
        return [*self.steps[k][:nc], *ys]


def requires_grad_flags(combine_fn, examples, flags, num_carry, known=None, reach=None):
    """(input flags with the carries' fixed point, output flags there, the loop's ``FlagOrbit`` or None).

    ``flags``: does each input (*init, *x, *lifted) require grad. A carry is
    made differentiable only when something requiring grad reaches it, so a
    mask or a counter carried along never asks for a gradient it cannot have.
    That fixed point decides what the backward computes; the orbit says which
    outputs require grad after a given number of steps, as in the loop.
    ``known``: carry flags -> output flags already found (by another trace). ``reach``: a
    ``flag_reach.Reach`` that reads them off a trace for the states it covers.
    """
    flags = [bool(f) and _differentiable(e) for f, e in zip(flags, examples)]
    rest, seen_outputs = flags[num_carry:], dict(known or {})

    def outputs(carry_flags):  # one trace per distinct carry-flag state the reach does not cover
        if carry_flags not in seen_outputs:
            if reach is not None and reach.covers(carry_flags):
                seen_outputs[carry_flags] = reach.outputs(carry_flags)
            else:
                seen_outputs[carry_flags] = _outputs_require_grad(combine_fn, examples, [*carry_flags, *rest])
        return seen_outputs[carry_flags]

    def carried(out):
        return tuple(bool(o) and _differentiable(e) for o, e in zip(out[:num_carry], examples))

    fixed = tuple(flags[:num_carry])
    while (grown := tuple(f or c for f, c in zip(fixed, carried(outputs(fixed))))) != fixed:
        fixed = grown  # flags only grow: this ends
    return [*fixed, *rest], outputs(fixed), _flag_orbit(tuple(flags[:num_carry]), outputs, carried, num_carry)


def flags_and_joint(combine_fn, examples, flags, num_carry, tangents):
    """``requires_grad_flags`` and the joint traced at their fixed point:
    (input flags, output flags, orbit, primals, joint).

    The joint is traced first with every floating carry requiring grad: the fixed point
    of a training scan (init's carry requiring grad, or a fresh carry a weight reaches
    in one step). Its trace tells which outputs require grad there, and its autograd
    graph which would with fewer carries requiring grad (``flag_reach``): init's state
    and any other the loop passes through then need no trace of their own (one trace
    of the body where a first call made two). Where the fixed point is smaller (a float
    carry nothing requiring grad reaches), the joint is traced again there; where the
    reach cannot be read (the body reads flags), each state is traced as before.
    """
    flags = [bool(f) and _differentiable(e) for f, e in zip(flags, examples)]
    start, rest = tuple(flags[:num_carry]), flags[num_carry:]
    upper = tuple(f or _differentiable(e) for f, e in zip(start, examples))
    stash, tried = {}, None
    primals = with_flags(examples, [*upper, *rest])
    try:
        tried = primals, trace_joint(combine_fn, primals, tangents, [*upper, *rest], stash, num_carry)
    except Exception:  # noqa: BLE001
        if upper == start:  # the fixed point itself (no carry can require grad beyond it): the body's error
            raise
        tried = None  # a failure only this guess met: the traces below decide (the body's own error recurs)
    known = {upper: stash["out_flags"]} if tried is not None else {}
    reach = stash.get("reach") if tried is not None else None
    grad_mask, out_grad, orbit = requires_grad_flags(combine_fn, examples, flags, num_carry, known, reach)
    if tried is None or tuple(grad_mask[:num_carry]) != upper:
        primals = with_flags(examples, grad_mask)
        tried = primals, trace_joint(combine_fn, primals, tangents, grad_mask)
    return (grad_mask, out_grad, orbit, *tried)


def _flag_orbit(state, outputs, carried, num_carry):
    """Follow the carries' flags from init's until a state repeats (None past ``_MAX_ORBIT``)."""
    seen, steps = {}, []
    while state not in seen:
        if len(steps) == _MAX_ORBIT:
            return None
        seen[state] = len(steps)
        out = outputs(state)
        steps.append(tuple(bool(o) for o in out))
        state = carried(out)
    return FlagOrbit(tuple(steps), seen[state], num_carry)


def _no_anomaly_check():
    """The joint's backward traced with anomaly mode off. Its check of each node's output for
    NaN reads a value: on the trace's fake tensors a data-dependent guard, which failed EVERY
    traced scan under ``torch.autograd.set_detect_anomaly(True)`` (torch.compile: a ScanError
    blaming the body; XLA: an AttributeError from torch formatting that error). Where the graph
    runs, anomaly mode still checks the scan's backward node as a whole."""
    return torch.autograd.set_detect_anomaly(False, check_nan=False)


def _tag_forward_nodes(num_primals):
    """Tag what the joint trace has recorded so far as the forward, as
    AOTAutograd does: newer torch's default_partition takes the forward to be
    every node up to the last one tagged "is_forward" (untagged, "save_all"
    would recompute everything). torch 2.9 reads only the backward tags;
    torch 2.14 reads both (``_has_tag_is_forward``). One tagging serves both."""
    mode = _compat.tracing.proxy_mode()
    if mode is None:
        return
    placeholders = 0
    for node in mode.tracer.graph.nodes:
        is_tangent = node.op == "placeholder" and placeholders >= num_primals
        placeholders += node.op == "placeholder"
        node.meta["partitioner_tag"] = "is_backward" if is_tangent else "is_forward"


def _joint_fn(combine_fn, grad_mask, stash, num_carry=None):
    """primals, tangents -> (*outputs, *grads): the shape AOTAutograd's partitioners expect.
    With ``num_carry``, ``stash["reach"]``: the step's ``flag_reach.Reach`` (or None)."""
    num_primals = len(grad_mask)

    def joint(*args):
        primals, tangents = args[:num_primals], args[num_primals:]
        watch = None if num_carry is None else FlagWatch()
        with stepping(combine_fn, primals, watch) as (outs, wrt, stash["outer"]):
            pass  # the backward below runs outside the stand-ins: its ops must not move devices
        stash["out_flags"] = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
        if watch is not None:  # read before the backward frees the autograd graph
            stash["reach"] = reach_or_none(outs, primals[:num_carry], watch)
        _tag_forward_nodes(num_primals)
        pairs = [(o, t) for o, t in zip(outs, tangents) if isinstance(o, torch.Tensor) and o.requires_grad]
        wanted = [reach for reach, m in zip(wrt, grad_mask) if m]
        used = [w for reach in wanted for w in reach if w.requires_grad]
        found = {}
        if pairs and used:  # anomaly mode off: its NaN check would read fake values (see _no_anomaly_check)
            with _no_anomaly_check():
                grads = torch.autograd.grad([o for o, _ in pairs], used, [t for _, t in pairs], allow_unused=True)
            found = {id(w): g for w, g in zip(used, grads) if g is not None}
        grads = [_sum([found[id(w)] for w in reach if id(w) in found]) for reach in wanted]
        grads = [torch.zeros_like(p) if g is None else g
                 for g, p in zip(grads, (p for p, m in zip(primals, grad_mask) if m))]
        it = iter(grads)
        return [*outs, *[next(it) if m else None for m in grad_mask]]

    return joint


def _sum(parts):
    if not parts:
        return None
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def trace_joint(combine_fn, primals, tangents, grad_mask, stash=None, num_carry=None):
    """The joint GraphModule over (*primals, *tangents); closures read by the
    user's body are rebound to the lifted primals. ``stash["out_flags"]``:
    which of the step's outputs required grad in the trace; with ``num_carry``,
    ``stash["reach"]`` (``_joint_fn``)."""
    stash = {} if stash is None else stash
    with _compat.eager_autograd_engine(), functions_as_ops(), _missing_derivative_is_an_error():
        joint = trace_graph(_joint_fn(combine_fn, grad_mask, stash, num_carry), [*primals, *tangents],
                                    force_enable_grad=True)
    src = source_of(combine_fn)
    if src is not None:
        first_lifted = len(primals) - len(src.lifted)
        _bind_closures(joint, src.lifted, stash.get("outer", lambda t: t), first_lifted)
    return joint


@contextlib.contextmanager
def _missing_derivative_is_an_error():
    """An op with no autograd kernel for the device (torch_xla's logdet, say)
    only warns, and its gradient comes out wrong: refuse it instead."""
    from ..core.trees import ScanError

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*an autograd kernel was not registered.*")
        try:
            yield
        except UserWarning as e:
            op = str(e).split(": an autograd kernel")[0]
            raise ScanError(
                f"scan: the body's gradient needs the backward of {op}, which has no autograd formula for "
                "these tensors' device (its gradient would be wrong); compute that step with other ops."
            ) from e


def _bind_closures(gm, lifted, outer, first_lifted):
    """Constants that are (stand-ins of) lifted closures -> their placeholders."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    index = {id(t): first_lifted + i for i, t in enumerate(lifted)}
    bound = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        k = index.get(id(outer(value))) if isinstance(value, torch.Tensor) else None
        if k is not None:
            node.replace_all_uses_with(placeholders[k])
            bound.append(node)
    for node in bound:
        gm.graph.erase_node(node)
        if hasattr(gm, node.target):
            delattr(gm, node.target)
    gm.graph.lint()
    gm.recompile()
