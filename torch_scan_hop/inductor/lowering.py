"""Inductor: every scan lowered to a while_loop here, reverse ones in place.

Inductor's post-grad pass ``decompose_scan_to_while_loop`` turns scan nodes
into ``while_loop`` in forward order only, and refuses kwargs. Under a compiler
our proxy rule emits a reverse scan as ``scan(..., reverse=True)``; the pass
here runs just before upstream's and lowers the scan nodes itself: a
``while_loop`` whose step ``i`` reads ``xs[i]`` (``xs[L-1-i]`` when reverse, a
view) and writes ``ys[i]`` in place. The forward-order alternative for reverse
gathers every slice and flips the ys afterwards: in a training backward,
copies of all saved activations and weight gradients. Forward scans are
lowered the same way so that one lowering (ours, the same on torch 2.9 and
2.14) holds the fixes every loop needs: a new carry is copied into its input's
strides when the body returns it in another layout (``(c @ W).mT``, or an
expanded gradient), as while_loop requires; scans of static length 0 become
their init and empty ys. ``install`` also puts in the workarounds of
``workarounds`` that every scan's while_loop needs on torch 2.9.
"""
import torch

from .. import _compat
from ..core.schedule import segments, step_index
from ..core.sym_sizes import KnownSizes
from ..core.trees import ScanError, split_counts
from . import (
    body_passes,
    buffer_pool,
    codegen,
    counter as loop_counter,
    cpp_wrapper,
    extern_rows,
    host_rows,
    pointwise_scan,
    row_writes,
    workarounds,
    wrapper_patches,
)

_installed = False
_WHILE = torch.ops.higher_order.while_loop
_LOOP_PREFIX = "scan_loop_"  # our while_loops' cond/body subgraphs: no per-iteration input asserts


def install():
    """Wrap upstream's pass (looked up by name when post-grad passes run) and
    apply the torch 2.9 inductor workarounds. Idempotent."""
    global _installed
    if _installed:
        return

    def before_upstream(gm):
        if not gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan):
            return  # a graph without a scan is left exactly as it was (no lint, no recompile)
        if pointwise_scan.lower_pointwise_scans(gm) and not gm.graph.find_nodes(
                op="call_function", target=torch.ops.higher_order.scan):
            return  # every scan became one kernel (CUDA, pointwise body)
        _refuse_complex_scans(gm)
        workarounds.materialize_expanded_operands(gm)
        _lower_scans(gm)

    _compat.inductor.run_before_scan_decomposition(before_upstream)
    wrapper_patches.skip_input_asserts_of_subgraphs(lambda name: _LOOP_PREFIX in name)
    wrapper_patches.keep_loop_outputs_out_of_cuda_graphs(lambda name: _LOOP_PREFIX in name)
    workarounds.keep_subgraph_inputs_undonated()
    workarounds.realize_copies_of_aliased_carries()
    workarounds.keep_carried_inputs_unreused()
    workarounds.pair_mutated_carries_by_index()
    workarounds.keep_polynomial_vec_indices_unsimplified()
    workarounds.mark_loop_outputs_unaligned(lambda name: _LOOP_PREFIX in name)
    wrapper_patches.reuse_no_aliasing_buffers()
    cpp_wrapper.track_cpp_wrapper_compiles()
    cpp_wrapper.name_mutated_carries_in_cpp_while_loops()
    cpp_wrapper.plan_cpp_subgraph_reuse_without_peak_estimate()
    extern_rows.write_extern_outputs_into_rows(lambda name: name.startswith(_LOOP_PREFIX) and "_body_" in name)
    codegen.install(lambda name: name.startswith(_LOOP_PREFIX))  # after the C++ while_loop fix above
    wrapper_patches.skip_output_asserts_of(torch.ops.torch_scan_hop.stacked_buffers.default)
    _installed = True


def _refuse_complex_scans(gm):
    """Inductor's pattern passes skip a node with a complex input or output (it leaves complex
    ops to eager kernels), so no pass lowers such a scan and upstream's then failed with a bare
    "scan is not lowered to while_loop". Say which leaf and what to do instead."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan):
        init, xs, lifted = node.args[1:4]
        named = [*((f"init leaf {i}", v) for i, v in enumerate(init)),
                 *((f"xs leaf {i}", v) for i, v in enumerate(xs)),
                 *((f"closed-over tensor {i}", v) for i, v in enumerate(lifted)),
                 *((f"ys leaf {i}", v) for i, v in enumerate(node.meta["val"][len(init):]))]
        for name, value in named:
            value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
            if isinstance(value, torch.Tensor) and value.is_complex():
                raise ScanError(
                    f"scan: inductor cannot compile a scan whose inputs or outputs are complex ({name} is "
                    f"{value.dtype} of shape {tuple(value.shape)}): it leaves complex tensors to eager kernels. "
                    "Carry and stack them as real pairs (torch.view_as_real outside the body, "
                    "torch.view_as_complex inside it), or compile with backend='aot_eager'.")


def _is_ours_to_lower(match):
    """Scan nodes with no option but ``reverse`` (the proxy rule emits no other)."""
    return set(match.nodes[0].kwargs) <= {"reverse"}


def _lower_scans(gm):
    def lower(match, combine, init, xs, lifted, **_kwargs):
        node = match.nodes[0]
        body = getattr(gm, combine.target)
        body_passes.unfuse_bias_adds(body)
        body_passes.copy_slices_into_unfaked_ops(body, len(init), len(xs))
        loop_body, in_place = row_writes.write_in_place(body, len(init))
        ys_vals = node.meta["val"][len(init):]
        flat = [*init, *xs, *lifted]
        counts = (len(init), len(xs), len(lifted))
        reverse = bool(node.kwargs.get("reverse", False))
        _allow_loop_index(node)
        marks = [_is_ours(loop) for _, loop in _nested_loops(body)]
        loops_before = set(gm.graph.find_nodes(op="call_function", target=_WHILE))
        dead = _unread_ys(node, len(init), len(ys_vals))
        match.replace_by_example(_as_multi_output(_while_loop(loop_body, ys_vals, counts, reverse, dead, in_place)), flat,
                                 run_functional_passes=False)
        for loop in gm.graph.find_nodes(op="call_function", target=_WHILE):
            if loop not in loops_before:
                _rename_nested_loops(getattr(gm, loop.args[1].target), marks)

    theirs = set(gm.graph.find_nodes(op="call_function", target=_WHILE))
    _compat.inductor.call_pattern_pass(torch.ops.higher_order.scan, _is_ours_to_lower, lower).apply(gm)
    _name_our_loops(gm, theirs)
    gm.graph.lint()
    gm.recompile()


def _unread_ys(node, nc, ny):
    """Indices of the ys nothing reads. The forward of a scan whose backward recomputes (the
    outer scan of traced ``remat="sqrt"``) holds its body's inner scan node with the values a
    backward would save as ys, unread there: stacking them cost a block-sized buffer and a
    write per step. Only when there is a carry to stand in for them in the replacement."""
    import operator

    users = list(node.users)
    if nc == 0 or any(u.op != "call_function" or u.target is not operator.getitem for u in users):
        return frozenset()
    read = {u.args[1] for u in users}
    return frozenset(k for k in range(ny) if nc + k not in read)


def _allow_loop_index(node):
    """Let the graph's ShapeEnv make the loop index an unbacked int (``counter.item()``).
    Our Dynamo tracker allows that when it captures a scan; a scan captured by
    upstream's tracker (upstream's front end ``torch._higher_order_ops.scan.scan``,
    whose graphs call this op), by make_fx or by export did not, and the lowering
    failed with ``DataDependentOutputException`` (a graph break, then eager, the whole
    inductor compile spent for nothing)."""
    mode = _compat.detect_fake_mode([v for v in node.meta["val"] if isinstance(v, torch.Tensor)])
    _compat.allow_scalar_outputs(getattr(mode, "shape_env", None))


def _as_multi_output(lowered):
    """``lowered`` returning at least two values. The pattern matcher replaces the scan node
    itself with a one-value replacement, leaving the scan's ``getitem(scan, 0)`` users
    indexing a tensor (a scan with one output: no carry and one y, as the backward of a body
    whose carry needs no gradient); with two or more values each user gets its own. The
    duplicate has no user."""
    def padded(*flat):
        out = lowered(*flat)
        return out if len(out) != 1 else [*out, out[0]]

    return padded


def _name_our_loops(gm, theirs):
    """Prefix the cond/body subgraphs of the while_loops made here with
    ``_LOOP_PREFIX``: inductor then leaves out their input asserts, which run on
    every iteration (the carried layouts are fixed by the lowering itself), and
    ``codegen`` runs them as counted ``for`` loops."""
    for node in gm.graph.find_nodes(op="call_function", target=_WHILE):
        if node not in theirs:
            _prefix_subgraphs(gm, node)


def _is_ours(loop):
    return loop.args[0].op == "get_attr" and loop.args[0].target.startswith(_LOOP_PREFIX)


def _prefix_subgraphs(gm, node):
    for sub in node.args[:2]:
        if sub.op != "get_attr" or sub.target.startswith(_LOOP_PREFIX):
            continue
        new, n = _LOOP_PREFIX + sub.target, 0
        while hasattr(gm, new):
            n += 1
            new = f"{_LOOP_PREFIX}{n}_{sub.target}"
        old = sub.target
        gm.register_module(new, getattr(gm, old))
        for user in gm.graph.find_nodes(op="get_attr", target=old):  # one module, maybe several get_attrs
            user.target = new
        delattr(gm, old)


def _nested_loops(gm):
    """``(graph module, while_loop node)`` of every while_loop in ``gm`` and in the subgraphs
    its nodes call, depth first in graph order: the order a re-trace of ``gm`` meets them."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _WHILE:
            yield gm, node
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                sub = getattr(gm, arg.target, None)
                if isinstance(sub, torch.fx.GraphModule):
                    yield from _nested_loops(sub)


def _rename_nested_loops(step, marks):
    """Give the loops nested in our new loop's body ``step`` back the prefix they had.

    Post-grad passes run on subgraphs first, so the scans in a scan's body were lowered (and
    their loops named ours) before the enclosing scan. Lowering that one traces its body
    again, and the trace names every while_loop it meets afresh (``while_loop_body_graph_0``):
    without the prefix the nested loops (remat="sqrt"'s inner scans, a scan a user wrote in
    a scan's body) got inductor's generic loop, a subgraph call and new buffers every step.
    The trace keeps the body's operations and their order, so the k-th loop found in
    ``step`` is the k-th of the body before (``marks[k]``: whether it was ours); when the
    counts differ nothing is renamed (inductor's generic loop: slower, still right)."""
    loops = list(_nested_loops(step))
    if len(loops) != len(marks):
        return
    renamed = {}
    for (owner, loop), ours in zip(loops, marks):
        if ours:
            _prefix_subgraphs(owner, loop)
            renamed[id(owner)] = owner
    for owner in renamed.values():
        owner.recompile()  # its code reads the subgraphs by attribute name


def _same_strides(a, b):
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return statically_known_true(sym_eq(tuple(a.stride()), tuple(b.stride())))


def _in_layout_of(new, old):
    """``new`` with ``old``'s strides (a copy only when they may differ)."""
    if not isinstance(new, torch.Tensor) or _same_strides(new, old):
        return new
    return torch.ops.prims.copy_strided.default(new, old.stride())


def _unaliased(carries):
    """``carries`` with each one that is (a view of) an earlier one cloned. A body may return one
    value as two carries (``return (h, h), y``), as in eager; inductor's while_loop refuses outputs
    that alias ("Output aliasing is currently not supported in compiled torch.while_loop").
    Aliasing is read from the storage, not ``_base``: a ``reshape`` (the body's views become
    reshapes, ``trace.peephole.views_to_reshapes``) decomposes into a view with no ``_base``."""
    seen, out = set(), []
    for c in carries:
        key = _compat.storage_identity(c) if isinstance(c, torch.Tensor) else None
        out.append(c.clone() if key is not None and key in seen else c)
        seen.add(key)
    return out


def _in_traced_layout(init):
    """``init`` in the layout the body was traced on: ``example_args`` cloned it, which
    makes a non-dense init (a slice of a wider tensor) dense, and the body's ``reshape``
    may be a ``view`` only that layout allows (inductor: "Cannot view a tensor with shape
    ... and strides ..."). Static sizes and strides only: an ``empty_like`` of symbolic ones
    here would make symbols the graph does not track (a symbolic non-dense init stays as it is).
    A non-contiguous init is pinned to that layout even where its strides already match: inductor
    may give the value it comes from (a transposed gradient) a flexible layout and realize the
    loop's input contiguous, while the body keeps the traced strides ("Expected carried_inputs
    and body_output to have same metadata ... stride: (3, 1) vs (1, 2)")."""
    if not isinstance(init, torch.Tensor) or not all(type(v) is int for v in (*init.shape, *init.stride())):
        return init
    with _compat.disable_proxy_modes_tracing():
        traced = torch.empty_like(init)  # clone's layout, nothing recorded
    if init.is_contiguous() or not _same_strides(init, traced):
        return _in_layout_of(init, traced)
    return torch.ops.prims.copy_strided.default(init, traced.stride())


def _preallocate(ys_vals, symbols):
    """Empty ys like ``ys_vals``, on storage reused between calls (see ``buffer_pool``):
    one operator call per dtype and device. Their sizes are computed from ``symbols`` ({sympy
    expression: SymInt} of the loop's inputs): traced values (``core.sym_sizes``)."""
    sizes = KnownSizes(symbols)
    resolve = lambda shape: [sizes.value_of(s) for s in shape]  # noqa: E731
    groups = {}
    for i, v in enumerate(ys_vals):
        groups.setdefault((v.dtype, v.device), []).append(i)
    ys = [None] * len(ys_vals)
    for (dtype, device), idx in groups.items():
        shapes = [(resolve(ys_vals[i].size()), resolve(ys_vals[i].stride())) for i in idx]
        for i, y in zip(idx, buffer_pool.stacked_buffers(shapes, dtype, device)):
            ys[i] = y
    return ys


def _loop_inputs(lifted):
    """(the lifted inputs the ``while_loop`` takes, ``{position: object}`` of the others).
    ``while_loop`` takes tensors and ints only (torch 2.15 checks); a scan's lifted inputs
    may also hold an opaque object (a process group's script object, which Dynamo lifts
    from a tensor-parallel body on torch 2.15): the loop body closes over those instead."""
    opaque = {k: a for k, a in enumerate(lifted) if not isinstance(a, (torch.Tensor, int, torch.SymInt))}
    return [a for k, a in enumerate(lifted) if k not in opaque], opaque


def _with_opaque(passed, opaque):
    """The body's lifted inputs: ``passed`` with the ``opaque`` objects back at their places."""
    out, rest = [], iter(passed)
    for k in range(len(passed) + len(opaque)):
        out.append(opaque[k] if k in opaque else next(rest))
    return out


def _while_loop(body, ys_vals, counts, reverse, dead=frozenset(), in_place=frozenset()):
    """The traced replacement: preallocated ys (pooled storage), a CPU counter, and a loop body that
    runs ``body`` on the views ``x[i]`` and copies each y into ``ys[i]`` (none for the ys in
    ``dead``: their outputs are the first carry, unread), with
    ``i = step_index(counter)`` (``L-1-counter`` when reverse). The counter starts at 0 and
    the body adds 1 to it in place (no new tensor per step): ``codegen.counted_loops`` relies
    on exactly that to read it as the Python loop variable of a static-length loop."""

    nc, nx, nl = counts
    on_host = host_rows.host_written_ys(body, nc)

    def lowered(*flat):
        init, xs, lifted = split_counts(flat, nc, nx, nl)
        init = [_in_traced_layout(c) for c in init]
        init = [c.clone() if k in in_place else c for k, c in enumerate(init)]
        length = xs[0].size(0)
        symbols = {a.node.expr: a for a in (*flat, length) if isinstance(a, torch.SymInt)}
        kept = [k for k in range(len(ys_vals)) if k not in dead]
        ys = _preallocate([ys_vals[k] for k in kept], symbols)
        ny = len(ys)

        def outputs(carry, bufs):
            stacked = dict(zip(kept, bufs))
            return [*carry, *(stacked[k] if k in stacked else carry[0] for k in range(len(ys_vals)))]

        # no step: the bounds asserts would fail statically; a symbolic length whose example
        # is 0 too (torch 2.15 traced the step and its select failed the index check)
        if _compat.is_zero_here(length) or not segments(length):
            return outputs([c.clone() for c in init], ys)

        def cond(counter, *_rest):
            return counter < length

        passed, opaque = _loop_inputs(lifted)

        def step(counter, *rest):
            bufs, carry, xs_, passed_ = split_counts(rest, ny, nc, nx, len(passed))
            lifted_ = _with_opaque(passed_, opaque)
            i = step_index(counter.item(), length, reverse=reverse)
            torch.ops.aten._assert_scalar.default(i >= 0, "scan: index below 0")
            torch.ops.aten._assert_scalar.default(i < length, "scan: index past the end")
            out = body(*carry, *(x.select(0, i) for x in xs_), *lifted_)
            for k, buf in zip(kept, bufs):
                y = out[nc + k]
                if k in on_host:  # a value whose device only the run knows (``host_rows``)
                    host_rows.copy_row(buf, i, y)
                else:
                    buf.select(0, i).copy_(y)
            new_carry = [_in_layout_of(new, old) for new, old in zip(_unaliased(out[:nc]), carry)]
            loop_counter.step(counter, operators)
            return (counter, *bufs, *new_carry)

        operators = loop_counter.uses_operators(flat)
        counter = loop_counter.new_counter(operators)
        # xs are read only: loop inputs, not carried (fewer values passed per step)
        res = torch.ops.higher_order.while_loop(cond, step, (counter, *ys, *init), (*xs, *passed))
        return outputs(res[1 + ny:1 + ny + nc], res[1:1 + ny])

    return lowered
