"""One step of the body as a partitioned forward/backward pair (the public ``fwd_bwd``).

The body's joint graph (outputs and input-gradients of ONE step) is traced once
with make_fx and split by a functorch partitioner, exactly as AOTAutograd does
for a whole model. The result has a documented, stable signature::

    fwd(*carry, *x, *lifted)            -> (*new_carry, *y, *saved)
    bwd(*saved, *grad_new_carry, *grad_y) -> (*grad_carry, *grad_x, *grad_lifted)

``bwd`` takes one gradient per output (those of integer/bool outputs are
ignored; pass None) and returns one per input (None where an input has no
gradient: integer inputs, or x/lifted inputs that do not require grad).
"""
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .. import _compat
from ..remat.partition import drop_names, partition_fn
from .copies import differentiable_copies
from .graph import forget_constants, trace_graph
from .joint import flags_and_joint
from .peephole import drop_aliases, recompute_saved_extrema, save_dense_layouts, simplify


def _differentiable(t):
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _name_joint_placeholders(joint, num_primals):
    """Partitioners tell primals from tangents by placeholder name, as AOTAutograd names them."""
    for i, node in enumerate(joint.graph.find_nodes(op="placeholder")):
        new = f"primals_{i + 1}" if i < num_primals else f"tangents_{i - num_primals + 1}"
        node.target = new
        _compat.rename_node(node, new)
    joint.recompile()


@dataclass
class FwdBwd:
    """A partitioned body step. ``saved_from[i]`` says where saved value i comes from:
    ("step", None) for a value the forward computes, or ("carry"|"x"|"lifted", k)
    when it is simply that input (so a scan can reuse it instead of stacking it)."""

    fwd: torch.fx.GraphModule
    bwd: torch.fx.GraphModule
    num_carry: int
    num_x: int
    num_lifted: int
    num_y: int
    out_vals: list  # example (fake) values of the step's outputs
    grad_mask: list  # per input: does bwd return a gradient for it
    out_grad: list  # per output: does it require grad (bwd takes a tangent for it)
    saved_from: list
    lifted: list = field(default_factory=list)
    carry_spec: Optional[Any] = None
    x_spec: Optional[Any] = None
    y_spec: Optional[Any] = None
    flag_orbit: Any = None  # the loop's output requires_grad per step count (``joint.FlagOrbit``), if known

    @property
    def num_saved(self):
        return len(self.saved_from)


def _is_view(node):
    target = node.target
    return _compat.is_op_overload(target) and (
        target.is_view or target is torch.ops.aten._unsafe_view.default)


@functools.lru_cache(maxsize=None)
def _gather_ops():
    """All-gather and wait of functional collectives (what a DTensor's redistribute to
    Replicate traces to: FSDP2's unshard of a layer's slice), and the data movement
    that puts gathered shards together."""
    ops = set()
    c10d = getattr(torch.ops, "_c10d_functional", None)
    for name in ("all_gather_into_tensor", "wait_tensor"):
        if c10d is not None and hasattr(c10d, name):
            ops.add(getattr(c10d, name).default)
    aten = torch.ops.aten
    return frozenset(ops), frozenset(ops) | {
        aten.cat.default, aten.constant_pad_nd.default, aten.clone.default, aten._to_copy.default,
        aten.split.Tensor, aten.split_with_sizes.default, aten.split_with_sizes_copy.default, operator.getitem}


def _recompute_roots(node, invariant, per_step):
    """The step inputs the backward can recompute ``node`` from, or None.

    From lifted (loop-invariant) inputs any deterministic op qualifies; from
    x slices only views do (``t(W[i])`` in scan_layers), and all-gathers (an
    FSDP2-sharded layer's slice gathered in full: gathered again in the backward,
    as FSDP2 reshards after forward, instead of a full copy of every layer's
    weights saved), since recomputing real work every backward step would cost
    more than saving its result. Carries and random ops make a value truly
    per-step: None.
    """
    gathers, moves = _gather_ops()
    roots, stack, seen, views_only, moves_only, gathered, uses_x = [], [node], set(), True, True, False, False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n not in invariant and n not in per_step:
                return None
            uses_x |= n in per_step
            roots.append(n)
        elif n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return None
        else:
            views_only &= _is_view(n)
            moves_only &= _is_view(n) or n.target in moves
            gathered |= n.target in gathers
            stack.extend(n.all_input_nodes)
    return None if uses_x and not (views_only or (gathered and moves_only)) else roots


def _hoist_recomputable_saves(joint, fwd, bwd, num_outputs, num_carry, num_x):
    """Partitioners happily save ``t(weight)``: per scan step that is a stacked
    copy of a loop-invariant (a closure) or of an x slice (scan_layers' stacked
    weights). Save the input instead (a closure is read once, an x slice is
    re-sliced from xs) and let the backward recompute the cheap op."""
    (outs,) = fwd.graph.find_nodes(op="output")[0].args
    by_name = {n.name: n for n in joint.graph.nodes}
    placeholders = [n for n in joint.graph.find_nodes(op="placeholder") if "tangents" not in n.target]
    per_step = set(placeholders[num_carry:num_carry + num_x])
    invariant = set(placeholders[num_carry + num_x:])
    saved, changed = [], False
    for out in outs[num_outputs:]:
        node = by_name[out.name]
        roots = None if node.op == "placeholder" else _recompute_roots(node, invariant, per_step)
        changed |= roots is not None
        for n in roots if roots is not None else [node]:
            if n not in saved:
                saved.append(n)
    return _compat.extract_fwd_bwd(joint, saved, num_outputs) if changed else (fwd, bwd)


def _view_base(node):
    """The node whose storage ``node`` views (itself when it is no view): through view
    ops and the items of multi-output views (``split``'s q, k, v)."""
    while node.op == "call_function":
        src = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(src, torch.fx.Node) and _is_view(src):
            node = src.args[0]
        elif _is_view(node) and isinstance(src, torch.fx.Node):
            node = src
        else:
            break
    return node


def _nbytes(node):
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _save_view_bases(joint, fwd, bwd, num_outputs):
    """Partitioners save views of one computed value separately (q, k and v split
    from one matmul; a value and its reshape): a scan stacks each, a copy per
    view and step. Save their base once instead when the views together are at
    least as big (the backward re-views it for free), and a matmul writing the
    base can then write its stacked row directly."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    (outs,) = fwd.graph.find_nodes(op="output")[0].args
    by_name = {n.name: n for n in joint.graph.nodes}
    saved = [by_name[o.name] for o in outs[num_outputs:]]
    groups = {}
    for n in saved:
        base = _view_base(n)
        if base is not n and base.op == "call_function" and isinstance(base.meta.get("val"), torch.Tensor) \
                and isinstance(n.meta.get("val"), torch.Tensor):
            groups.setdefault(base, []).append(n)
    # sizes of symbolic values: arithmetic on their symbols must not be recorded in an outer trace
    with _compat.disable_proxy_modes_tracing():
        bases = {base: views for base, views in groups.items()
                 if statically_known_true(sum(_nbytes(v) for v in views) >= _nbytes(base))}
    if not bases:
        return fwd, bwd
    replaced = {v: base for base, views in bases.items() for v in views}
    new = []
    for n in saved:
        n = replaced.get(n, n)
        if n not in new:
            new.append(n)
    return _compat.extract_fwd_bwd(joint, new, num_outputs)


def _input_kind(i, num_carry, num_x):
    if i < num_carry:
        return ("carry", i)
    if i < num_carry + num_x:
        return ("x", i - num_carry)
    return ("lifted", i - num_carry - num_x)


def _align_saves(fwd, bwd, num_outputs):
    """Reorder the forward's saved outputs to the backward's input order.

    Partitioners name each backward input after the forward node it receives
    and order them as they like (AOT puts sizes first, and a size Dynamo lifts
    can be saved twice): matching by name makes "saved i is backward input i"
    hold whatever the partitioner or torch version."""
    fwd_out = fwd.graph.find_nodes(op="output")[0]
    (outs,) = fwd_out.args
    saved = {n.name: n for n in outs[num_outputs:]}
    # the target keeps the forward node's name when FX renamed a duplicate input
    wanted = [ph.target for ph in bwd.graph.find_nodes(op="placeholder") if not ph.target.startswith("tangents")]
    if not set(wanted) <= set(saved):
        raise AssertionError(f"scan: partition saves {sorted(saved)} but its backward reads {sorted(wanted)}")
    fwd_out.args = (tuple(outs[:num_outputs]) + tuple(saved[name] for name in wanted),)
    fwd.recompile()
    return fwd, bwd


def _inline_constant_saves(fwd, bwd, num_outputs):
    """Saved plain Python numbers (static sizes the backward reads) become
    constants of the backward graph instead of per-step saved values.
    Expects ``_align_saves``' order (saved i is backward input i)."""
    fwd_out = fwd.graph.find_nodes(op="output")[0]
    (outs,) = fwd_out.args
    saved = list(outs[num_outputs:])
    bwd_inputs = list(bwd.graph.find_nodes(op="placeholder"))
    keep = []
    for node, ph in zip(saved, bwd_inputs):
        val = node.meta.get("val")
        if isinstance(val, (int, float, bool)) and not isinstance(val, torch.SymInt):
            ph.replace_all_uses_with(val)
            bwd.graph.erase_node(ph)
        else:
            keep.append(node)
    if len(keep) == len(saved):
        return fwd, bwd
    fwd_out.args = (tuple(outs[:num_outputs]) + tuple(keep),)
    for gm in (fwd, bwd):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return fwd, bwd


def _dedupe_saves(fwd, bwd, num_outputs):
    """One saved value per forward node. Dropping ``checkpoint_name``'s copies leaves the named
    value saved twice where both it and its copy were saved (tanh saves its output, the next
    matmul its input); every saved value is one stacked (T, ...) buffer of the compiled loop, so a
    duplicate doubles its memory (a named 4-layer MLP saved 8 step values for the eager tape's 5).
    Expects ``_align_saves``' order (saved i is backward input i)."""
    fwd_out = fwd.graph.find_nodes(op="output")[0]
    (outs,) = fwd_out.args
    saved = list(outs[num_outputs:])
    bwd_inputs = list(bwd.graph.find_nodes(op="placeholder"))[:len(saved)]
    first, keep = {}, []
    for node, ph in zip(saved, bwd_inputs):
        if node in first:
            ph.replace_all_uses_with(first[node])
            bwd.graph.erase_node(ph)
        else:
            first[node] = ph
            keep.append(node)
    if len(keep) == len(saved):
        return fwd, bwd
    fwd_out.args = (tuple(outs[:num_outputs]) + tuple(keep),)
    for gm in (fwd, bwd):
        gm.recompile()
    return fwd, bwd


def _classify_saved(fwd, num_outputs, num_carry, num_x):
    placeholders = list(fwd.graph.find_nodes(op="placeholder"))
    (outs,) = fwd.graph.find_nodes(op="output")[0].args
    saved_nodes = list(outs[num_outputs:])

    def kind(n):
        if isinstance(n.meta.get("val"), torch.SymInt):  # a symbolic size: the same every step
            return ("sym", None)
        return _input_kind(placeholders.index(n), num_carry, num_x) if n.op == "placeholder" else ("step", None)

    return [kind(n) for n in saved_nodes]


def _mutates(gm):
    return any(n.op == "call_function" and _compat.is_op_overload(n.target)
               and _compat.op_schema(n.target).is_mutable for n in gm.graph.nodes)


def _has_symbols(values):
    return any(isinstance(d, torch.SymInt) for v in values if isinstance(v, torch.Tensor) for d in v.shape)


def _output_metas(gm, examples):
    """The body's output values (for their shape/dtype) from its graph, when it
    is one that carries them: saves a trace of the body. Symbolic recorded
    shapes only hold for symbolic examples (a make_fx(tracing_mode="symbolic")
    graph later runs on real tensors of other sizes)."""
    if not isinstance(gm, torch.fx.GraphModule):
        return None
    outs = gm.graph.find_nodes(op="output")
    if not outs or not isinstance(outs[0].args[0], (list, tuple)):
        return None
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in outs[0].args[0]]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    return None if _has_symbols(vals) and not _has_symbols(examples) else vals


@dataclass
class JointStep:
    """One step's joint graph and what partitioning it needs (see ``trace_step``)."""

    joint: torch.fx.GraphModule
    primals: list
    tangents: list
    grad_mask: list
    out_grad: list
    out_vals: list
    num_carry: int
    num_x: int
    num_lifted: int
    flag_orbit: Any  # the loop's output flags per step (``joint.FlagOrbit``), or None


def trace_step(body: Callable, carry, x, lifted, requires_grad) -> JointStep:
    """Trace the joint graph of one step of ``body(*carry, *x, *lifted) -> [*new_carry, *y]``.

    ``carry``/``x``/``lifted`` are example tensors of one step (any mode);
    ``requires_grad`` flags the inputs that require grad (for the carries:
    init's flags; the carries' fixed point is computed here).
    """
    body = differentiable_copies(body)
    examples = _detached_examples([*carry, *x, *lifted])
    out_vals = _output_metas(body, examples) or _output_metas(forget_constants(trace_graph(body, examples)), examples)
    with _compat.disable_proxy_modes_tracing():
        tangents = [torch.zeros(v.shape, dtype=v.dtype, device=v.device) for v in out_vals]
    grad_mask, out_grad, flag_orbit, primals, joint = flags_and_joint(body, examples, requires_grad, len(carry),
                                                                      tangents)
    return JointStep(joint, primals, tangents, list(grad_mask), list(out_grad), out_vals,
                     len(carry), len(x), len(lifted), flag_orbit)


def _drop_error_checks(joint):
    """Remove ``aten._linalg_check_errors`` (no value, nothing reads it) from the joint:
    torch 2.9 and 2.15's partitioners leave it out of both step graphs anyway, and torch
    2.11's ``default_partition`` asserts on it ("Expected _linalg_check_errors to be a
    tensor": any save_all scan whose body solves or inverts). The eager loop still checks."""
    check = torch.ops.aten._linalg_check_errors.default
    for node in list(joint.graph.find_nodes(op="call_function", target=check)):
        if not node.users:
            joint.graph.erase_node(node)
    joint.recompile()


def partition_step(step: JointStep, remat="save_all") -> FwdBwd:
    """Split a traced joint into the forward and backward graphs of one step. The graphs made
    on the way are lazy (``_compat.tracing.lazy_graph_modules``): each extraction and pass
    would otherwise write and compile Python code for graphs only read node by node (a
    quarter of the Python time of an XLA training scan's first call)."""
    with _compat.tracing.lazy_graph_modules():
        return _partition_step(step, remat)


def _partition_step(step, remat):
    joint, primals, tangents = step.joint, step.primals, step.tangents
    num_out, num_carry, num_x = len(step.out_vals), step.num_carry, step.num_x
    # Re-traced functionalized when it mutates: decompositions (GRUCell's, say) emit
    # in-place ops, and a backward writing into a slice of the stacked saved values
    # corrupts them. Most joints have none, and the re-trace costs as much as the trace.
    if _mutates(joint):
        with _compat.disable_proxy_modes_tracing():
            plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in (*primals, *tangents)]
        joint = trace_graph(torch.func.functionalize(joint, remove="mutations"), plain)
    drop_aliases(joint)
    _drop_error_checks(joint)
    _compat.drop_checkpoint_tags(joint)
    _name_joint_placeholders(joint, len(primals))
    fwd, bwd = partition_fn(remat)(joint, [*primals, *tangents], num_fwd_outputs=num_out)
    fwd, bwd = _hoist_recomputable_saves(joint, fwd, bwd, num_out, num_carry, num_x)
    fwd, bwd = _save_view_bases(joint, fwd, bwd, num_out)
    fwd, bwd = _align_saves(fwd, bwd, num_out)
    fwd, bwd = _inline_constant_saves(fwd, bwd, num_out)
    fwd, bwd = simplify(drop_names(fwd), keep_detach=True), simplify(drop_names(bwd))
    fwd, bwd = _dedupe_saves(fwd, bwd, num_out)
    fwd, bwd = recompute_saved_extrema(fwd, bwd, num_out)
    fwd, bwd = save_dense_layouts(fwd, bwd, num_out)
    return FwdBwd(
        fwd=fwd, bwd=bwd, num_carry=num_carry, num_x=num_x, num_lifted=step.num_lifted,
        num_y=num_out - num_carry, out_vals=step.out_vals, grad_mask=step.grad_mask,
        out_grad=step.out_grad, saved_from=_classify_saved(fwd, num_out, num_carry, num_x),
        flag_orbit=step.flag_orbit,
    )


def partition_body(body: Callable, carry, x, lifted, requires_grad, remat="save_all") -> FwdBwd:
    """``trace_step`` then ``partition_step``."""
    return partition_step(trace_step(body, carry, x, lifted, requires_grad), remat)


def _detached_examples(values):
    """Detached example values of one step, outside any graph. Under a fake
    mode a real tensor (a constant the body created, lifted) becomes fake, with
    static shapes: a fresh symbol would become a guard export cannot evaluate
    (``FakeTensorMode.from_tensor(static_shapes=True)``, torch 2.9 to 2.15)."""
    mode = _compat.detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    def example(v):
        if mode is not None and not isinstance(v, _compat.FakeTensor):
            v = mode.from_tensor(v, static_shapes=True)
        return v.detach()

    with _compat.disable_proxy_modes_tracing():
        return [example(v) if isinstance(v, torch.Tensor) else v for v in values]
