"""Autograd. In plain eager the loop runs ON the tape (``loop.run_flat``):
exactly the loop's gradients, whatever the body does. Traced (make_fx,
AOTAutograd, export) and on XLA the forward scan saves what the partitioned
backward needs and the backward is itself a scan (reverse direction) over the
backward graph.

On the traced path nothing is recorded per step: the body's joint graph is
traced once (``partition.partition_body``), the forward scan runs the ``fwd``
graph and stacks the per-step saved values, and ``backward`` runs one more
``scan_op`` whose carry holds the carry-gradient and the running sum of the
closure gradients. Saved values that are just an x slice or a closure are not
stacked: the backward reads xs / the closure directly.
"""
import copy

import torch

from .. import _compat
from ..core import route, trace_lock
from ..core.op_args import example_args
from ..core.sym_sizes import KnownSizes
from ..trace import cache, shift
from ..trace.body_checks import mark_functional
from ..trace.lift import source_of
from ..trace.partition import FwdBwd, partition_step, trace_step
from ..trace.peephole import fuse_accumulate
from ..xla import sharding
from ..core.trees import ScanError
from ..trace import example_values
from .compile_errors import NOT_A_GRAPH_BREAK
from .hop import scan_op
from .loop import run_flat


def _sym_graph(fb: FwdBwd, sym_saved):
    """fwd graph trimmed to the symbolic sizes the backward needs (they depend on
    shapes only, so one evaluation on the inputs serves every step)."""
    gm = _compat.tracing.lazy_graph_module(fb.fwd, copy.deepcopy(fb.fwd.graph))
    out_node = gm.graph.find_nodes(op="output")[0]
    (outs,) = out_node.args
    out_node.args = ([outs[fb.num_carry + fb.num_y + i] for i in sym_saved],)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _step_sym_sizes(plan, init, xs, lifted):
    """The symbolic sizes the backward step reads (``plan.sym_saved``), each made from the
    inputs' own sizes. They depend on shapes only, so ``plan.sym_graph`` runs on stand-ins of
    one step (x slices made from nothing: xs may have no row) outside any make_fx trace. Run
    under the trace, its ops were recorded on the stand-ins: uninitialized tensors in the
    caller's graph, where a step index read from one (``buf[:, t]``, kept alive by an op
    torch 2.9 never drops, a seeded one) failed or read out of range when the graph ran."""
    if plan.sym_graph is None:
        return []
    with _compat.disable_proxy_modes_tracing():
        sizes = plan.sym_graph(*init, *(x.new_empty(x.shape[1:]) for x in xs), *lifted)
    known = KnownSizes(_symbolic_sizes_of([*init, *xs, *lifted]))
    return [known.value_of(s) if isinstance(s, torch.SymInt) and known.computable(s) else s for s in sizes]


def _symbolic_sizes_of(values):
    """{sympy expression: SymInt} of the sizes and strides of ``values`` (and of SymInt
    values themselves: Dynamo lifts free symbols), the first one of each expression."""
    known = {}
    for v in values:
        ints = [v] if isinstance(v, torch.SymInt) else []
        if isinstance(v, torch.Tensor):
            ints = [*v.shape, *(v.stride() if v.layout == torch.strided else ())]
        for i in ints:
            if isinstance(i, torch.SymInt):
                known.setdefault(i.node.expr, i)
    return known


def _fwd_step_graph(fb: FwdBwd, step_saved):
    """fwd graph trimmed to (*new_carry, *y, *per-step saved); outputs that are
    inputs get a clone so the body never returns an alias of its argument."""
    gm = _compat.tracing.lazy_graph_module(fb.fwd, copy.deepcopy(fb.fwd.graph))  # shares constants, copies nodes
    out_node = gm.graph.find_nodes(op="output")[0]
    (outs,) = out_node.args
    num_out = fb.num_carry + fb.num_y
    keep = list(outs[:num_out]) + [outs[num_out + i] for i in step_saved]
    with gm.graph.inserting_before(out_node):
        keep = [gm.graph.call_function(torch.ops.aten.clone.default, (n,)) if n.op == "placeholder" else n
                for n in keep]
    out_node.args = (keep,)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


class ScanGradPlan:
    """Index bookkeeping between the forward scan, the saved values and the backward scan.
    ``shifts``: saved carries the backward rebuilds from the previous step's saved
    values instead of reading a stack of their own (``trace.shift``)."""

    def __init__(self, fb: FwdBwd, reverse, shifts=()):
        self.fb, self.reverse, self.shifts = fb, reverse, list(shifts)
        kinds = fb.saved_from
        shifted = {s.saved for s in self.shifts}
        self.step_saved = [i for i, (k, _) in enumerate(kinds) if k in ("step", "carry") and i not in shifted]
        self.x_needed = sorted({j for k, j in kinds if k == "x"})
        self.lifted_needed = sorted({j for k, j in kinds if k == "lifted"})
        self.sym_saved = [i for i, (k, _) in enumerate(kinds) if k == "sym"]
        self.sym_graph = _sym_graph(fb, self.sym_saved) if self.sym_saved else None
        self.fwd_step = mark_functional(_fwd_step_graph(fb, self.step_saved))
        nc, nx = fb.num_carry, fb.num_x
        self.carry_grad = [i for i in range(nc) if fb.grad_mask[i]]
        self.x_grad = [i for i in range(nx) if fb.grad_mask[nc + i]]
        self.lifted_grad = [i for i in range(fb.num_lifted) if fb.grad_mask[nc + nx + i]]
        self.y_grad = [j for j in range(fb.num_y) if fb.out_grad[nc + j]]
        # the backward scan needs an xs even when no value is per step (c * 2 + x)
        self.length_only = not (self.step_saved or self.x_needed or self.y_grad)

        # positions in step_saved of the stacks the shifted carries are rebuilt from
        self.stacked_leaves = sorted({self.step_saved.index(leaf) for s in self.shifts for leaf in s.leaves})
        self.bwd_step = mark_functional(_bwd_step_graph(self))
        self._shifted = None if shifts else ()

    def shifted(self):
        """This plan with its shiftable saved carries rebuilt (None if there is none)."""
        if self._shifted == ():
            found = shift.find_shifts(self.fb)
            found = [s for s in found if set(s.lifted) <= set(self.lifted_needed)
                     and shift.worth_it(self.fb.out_vals[s.carry])]
            self._shifted = ScanGradPlan(self.fb, self.reverse, found) if found else None
        return self._shifted


def _bwd_step_graph(plan):
    """The backward scan's body as one GraphModule:

        (*g_carry, *g_lifted_sum, *step_saved, *x_needed, *g_y, *lifted_needed, *sym_sizes)
            -> [*g_carry_in, *g_lifted_sum + g_lifted, *g_x]

    ``fb.bwd``'s nodes are inlined behind placeholders in that order, so each
    step is one straight-line graph call (no Python bookkeeping per step) and
    the body traces like any other graph (make_fx, XLA).
    """
    fb = plan.fb
    graph = torch.fx.Graph()

    def inputs(prefix, n):
        return [graph.placeholder(f"{prefix}_{k}") for k in range(n)]

    g_carry = inputs("g_carry", len(plan.carry_grad))
    g_sum = inputs("g_lifted_sum", len(plan.lifted_grad))
    step = iter(inputs("saved", len(plan.step_saved)))
    xs = dict(zip(plan.x_needed, inputs("x", len(plan.x_needed))))
    g_y = dict(zip(plan.y_grad, inputs("g_y", len(plan.y_grad))))
    inputs("length_only", int(plan.length_only))  # the zero-width xs slice when nothing is per step
    prev_first = inputs("shift_row", 2) if plan.shifts else None
    lifted = dict(zip(plan.lifted_needed, inputs("lifted", len(plan.lifted_needed))))
    syms = iter(inputs("sym", len(plan.sym_saved)))
    rebuilt = _rebuild_shifted(plan, graph, inputs, prev_first, lifted)
    saved = [rebuilt[i] if i in rebuilt else next(step) if k in ("step", "carry")
             else next(syms) if k == "sym" else (xs[j] if k == "x" else lifted[j])
             for i, (k, j) in enumerate(fb.saved_from)]
    tangents = [None] * fb.num_carry + [g_y.get(j) for j in range(fb.num_y)]
    for i, g in zip(plan.carry_grad, g_carry):
        tangents[i] = g
    val_map = dict(zip(fb.bwd.graph.find_nodes(op="placeholder"), saved + tangents))
    grads = graph.graph_copy(fb.bwd.graph, val_map)
    nc, nx = fb.num_carry, fb.num_x
    sums = [fuse_accumulate(graph, graph.call_function(torch.ops.aten.add.Tensor, (s, grads[nc + nx + i])))
            for s, i in zip(g_sum, plan.lifted_grad)]
    graph.output([*(grads[i] for i in plan.carry_grad), *sums, *(grads[nc + i] for i in plan.x_grad)])
    return _compat.tracing.lazy_graph_module(fb.bwd, graph)


def _rebuild_shifted(plan, graph, inputs, prev_first, lifted):
    """Saved index -> node rebuilding it (``shift.rebuild_carries``); the stacks of
    the leaves and the inits come last, after the sym sizes."""
    if not plan.shifts:
        return {}
    stacks = inputs("shift_stack", len(plan.stacked_leaves))
    inits = inputs("shift_init", len(plan.shifts))
    by_saved = {plan.step_saved[pos]: node for pos, node in zip(plan.stacked_leaves, stacks)}
    return shift.rebuild_carries(graph, plan.shifts, *prev_first, by_saved, inits, lifted)


class ScanAutogradFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, unroll, num_init, num_xs, *flat):
        init, xs, lifted = flat[:num_init], flat[num_init:num_init + num_xs], flat[num_init + num_xs:]
        if shift.use_shift(flat, unroll, xs[0].shape[0]):
            plan = plan.shifted() or plan
        out = scan_op(plan.fwd_step, init, xs, lifted, reverse=plan.reverse, unroll=unroll)
        ctx.unroll, ctx.length, ctx.xs_device = unroll, xs[0].shape[0], xs[0].device
        num_out = num_init + plan.fb.num_y
        result, step_saved = out[:num_out], out[num_out:]
        ctx.sym_sizes = _step_sym_sizes(plan, init, xs, lifted)
        ctx.plan, ctx.num_init, ctx.num_xs = plan, num_init, num_xs
        # additional inputs may be SymInts (Dynamo lifts free symbols): only tensors are saved
        ctx.lifted_scalars = [None if isinstance(a, torch.Tensor) else a for a in lifted]
        ctx.save_for_backward(*step_saved, *(init[s.carry] for s in plan.shifts), *(xs[i] for i in plan.x_needed),
                              *(lifted[i] for i in plan.lifted_needed if isinstance(lifted[i], torch.Tensor)),
                              *(a for a in lifted if isinstance(a, torch.Tensor)))
        ctx.out_meta = [(r.shape, r.dtype, r.device) for r in result]
        ctx.shardings = sharding.of(flat)  # SPMD: each gradient gets its input's sharding
        ctx.mark_non_differentiable(*(r for r, d in zip(result, _output_differentiable(plan, init, xs)) if not d))
        return tuple(result)

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        saved = list(ctx.saved_tensors)
        n_step, n_x, n_l = len(plan.step_saved) + len(plan.shifts), len(plan.x_needed), len(plan.lifted_needed)
        step_saved, inits = saved[:len(plan.step_saved)], saved[len(plan.step_saved):n_step]
        xs_needed = saved[n_step:n_step + n_x]
        lifted = _with_scalars(saved[n_step + n_x + n_l:], ctx.lifted_scalars)
        lifted_needed = [lifted[i] for i in plan.lifted_needed]
        num_init = ctx.num_init
        g_carry = [_grad_or_zeros(grads[i], ctx.out_meta[i]) for i in plan.carry_grad]
        g_y = [_grad_or_zeros(grads[num_init + j], ctx.out_meta[num_init + j]) for j in plan.y_grad]
        shardings = ctx.shardings
        num_xs = ctx.num_xs
        g_sum0 = [sharding.like(torch.zeros_like(lifted[i]), shardings[num_init + num_xs + i])
                  for i in plan.lifted_grad]
        per_step = [torch.empty((ctx.length, 0), device=ctx.xs_device)] if plan.length_only else [
            *step_saved, *xs_needed, *g_y]
        shifted = []
        if plan.shifts:
            per_step += shift.previous_rows(ctx.length, plan.reverse, ctx.xs_device)
            shifted = [*(step_saved[i] for i in plan.stacked_leaves), *inits]
        out = scan_op(plan.bwd_step, [*g_carry, *g_sum0], per_step,
                      (*lifted_needed, *ctx.sym_sizes, *shifted), reverse=not plan.reverse, unroll=ctx.unroll)
        it = iter(out)
        g_init = dict(zip(plan.carry_grad, [next(it) for _ in plan.carry_grad]))
        g_lifted = dict(zip(plan.lifted_grad, [next(it) for _ in plan.lifted_grad]))
        g_xs = dict(zip(plan.x_grad, [next(it) for _ in plan.x_grad]))
        if type(ctx.length) is int and ctx.length == 0:  # no step ran: the loop never used xs or closures
            g_xs, g_lifted = {}, {}
        in_grads = [*(g_init.get(i) for i in range(num_init)), *(g_xs.get(i) for i in range(num_xs)),
                    *(g_lifted.get(i) for i in range(len(lifted)))]
        return (None, None, None, None, *(sharding.like(g, s) for g, s in zip(in_grads, shardings)))


def _output_differentiable(plan, init, xs):
    """Per output: does it require grad, as after the loop. A zero-length scan
    returns init; after L steps a carry may not require grad yet, or any more
    (the body overwrote it). A symbolic length takes the carries' fixed point."""
    fb = plan.fb
    length = xs[0].shape[0]
    if isinstance(length, int) and length == 0:
        return [t.requires_grad for t in init] + list(fb.out_grad[fb.num_carry:])
    if isinstance(length, int) and fb.flag_orbit is not None:
        return fb.flag_orbit.after(length)
    return list(fb.out_grad)


def _with_scalars(tensors, scalars):
    it = iter(tensors)
    return [next(it) if s is None else s for s in scalars]


def _grad_or_zeros(g, meta):
    """autograd passes None for outputs nobody used; the backward scan needs zeros."""
    if g is not None:
        return g
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _needs_grad(flat):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)


def build_plan(combine_fn, init, xs, additional_inputs, reverse, remat):
    """The partitioned step of this call, reused for an identical step.

    A body traced by ``scan``'s front end has a user function behind it
    (``lift.source_of``) whose joint only a fresh trace can tell: the plan is
    keyed by that joint. Any other graph body (Dynamo's, or our own backward)
    is differentiated as it is, so its joint is a function of the graph: the
    plan is keyed by the body graph itself, with no trace on a hit.
    Under a fake-mode trace (AOT, make_fx) the plan of a graph body is kept with
    that fake mode: AOT runs the graph more than once, and a scan nested in
    another's body is planned again on each trace of the outer body.
    """
    nc, nx = len(init), len(xs)
    flat = [*init, *xs, *additional_inputs]
    requires_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in flat]

    def trace():  # the examples are made here, only for a trace: on XLA each is graph work (~0.1 ms)
        with torch.no_grad(), _compat.disable_proxy_modes_tracing():
            examples = example_args(init, xs, additional_inputs)
        try:
            return trace_step(combine_fn, examples[:nc], examples[nc:nc + nx], examples[nc + nx:], requires_grad)
        except RuntimeError as e:
            if isinstance(e, ScanError) or not _compat.dispatch_modes_active():
                raise
            # traced (AOT, make_fx): the body's backward failing is named as the body's error
            raise ScanError(f"torch_scan_hop.scan: the body fn raised {type(e).__name__} when its joint forward and "
                            f"backward were traced on one step's shapes {NOT_A_GRAPH_BREAK}: {e}") from e

    def plan(step):
        return ScanGradPlan(partition_step(step, remat), reverse)

    scope = None
    if _compat.dispatch_modes_active() or not all(_compat.is_concrete(t) for t in flat):
        scope = _compat.detect_fake_mode([t for t in flat if isinstance(t, torch.Tensor)])
        if scope is None:  # real-mode make_fx: nothing outlives its trace to key a plan by
            return plan(trace())
    def by_joint(step):
        if scope is not None:  # a front end's body under a tracer: its joint may hold the trace's constants
            return plan(step)
        return cache.plan_for(step.joint, init, xs, additional_inputs, reverse, remat, lambda: plan(step))

    if isinstance(combine_fn, torch.fx.GraphModule) and source_of(combine_fn) is None:
        # a new body graph whose joint was planned already (XLA's eager entry: a first call
        # traced by make_fx, the next captured by Dynamo) reuses that plan
        return cache.plan_for(combine_fn, init, xs, additional_inputs, reverse, remat, lambda: by_joint(trace()),
                               keyed_by="body", scope=scope)
    return by_joint(trace())


@scan_op.py_impl(_compat.DispatchKey.Autograd)  # not py_autograd_impl: it would trace the body for a schema every call
def scan_autograd(combine_fn, init, xs, additional_inputs, *, reverse=False, remat="save_all", unroll=1):
    flat = [*init, *xs, *additional_inputs]
    if route.runs_the_loop(flat, remat):
        return run_flat(combine_fn, list(init), list(xs), tuple(additional_inputs), reverse, remat)
    if not _needs_grad(flat):
        with _compat.AutoDispatchBelowAutograd():
            return scan_op(combine_fn, init, xs, additional_inputs, reverse=reverse, unroll=unroll)
    if example_values.applies(combine_fn, flat):  # Dynamo asks only for the outputs' metadata
        return example_values.run(scan_op, combine_fn, init, xs, additional_inputs, reverse, unroll)
    with trace_lock.tracing_lock():
        plan = build_plan(combine_fn, init, xs, additional_inputs, reverse, remat)
    return list(ScanAutogradFn.apply(plan, unroll, len(init), len(xs), *flat))
