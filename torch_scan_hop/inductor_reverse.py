"""Inductor: reverse scans lowered natively, reading and writing slice L-1-i in place.

Inductor 2.9's post-grad pass ``decompose_scan_to_while_loop`` turns scan nodes
into ``while_loop`` in forward order only, and refuses kwargs. Under a compiler
our proxy rule emits a reverse scan as ``scan(..., reverse=True)``; the pass
here runs just before upstream's and lowers exactly those nodes to a
``while_loop`` whose step ``i`` reads ``xs[L-1-i]`` (a view) and writes
``ys[L-1-i]``. The forward-order alternative gathers every slice and flips the
ys afterwards: in a training backward, copies of all saved activations and
weight gradients. Scans of static length 0 are lowered here too (to their
init and empty ys). ``install`` also puts in the workarounds of
``_inductor_fixes`` that every scan's while_loop needs on torch 2.9.
"""
import torch

from . import _compat, _inductor_fixes
from ._schedule import segments, step_index

_installed = False


def install():
    """Wrap upstream's pass (looked up by name when post-grad passes run) and
    apply the torch 2.9 inductor workarounds. Idempotent."""
    global _installed
    if _installed:
        return

    def before_upstream(gm):
        _inductor_fixes.materialize_expanded_operands(gm)
        _inductor_fixes.restride_changed_carries(gm)
        _lower_reverse_scans(gm)

    _compat.inductor.run_before_scan_decomposition(before_upstream)
    _inductor_fixes.keep_subgraph_inputs_undonated()
    _installed = True


def _is_ours_to_lower(match):
    """Reverse scans, and scans of static length 0 (upstream's pass asserts the
    index is below the length while tracing its body, which fails for 0)."""
    node = match.nodes[0]
    if node.kwargs and (set(node.kwargs) != {"reverse"} or node.kwargs["reverse"] is not True):
        return False
    xs = node.args[2]
    return bool(node.kwargs) or (bool(xs) and not segments(xs[0].meta["val"].shape[0]))  # no step to run


def _lower_reverse_scans(gm):
    def lower(match, combine, init, xs, lifted, **_kwargs):
        node = match.nodes[0]
        body = getattr(gm, combine.target)
        ys_vals = node.meta["val"][len(init):]
        flat = [*init, *xs, *lifted]
        counts = (len(init), len(xs), len(lifted))
        match.replace_by_example(_reverse_while_loop(body, ys_vals, counts), flat, run_functional_passes=False)

    _compat.inductor.call_pattern_pass(torch.ops.higher_order.scan, _is_ours_to_lower, lower).apply(gm)
    gm.graph.lint()
    gm.recompile()


def _split(seq, *counts):
    out, start = [], 0
    for n in counts:
        out.append(list(seq[start:start + n]))
        start += n
    return out


def _reverse_while_loop(body, ys_vals, counts):
    """The traced replacement: preallocated ys, a CPU counter, and a loop body that
    runs ``body`` on the views ``x[L-1-i]`` and copies each y into ``ys[L-1-i]``."""
    resolve_shape_to_proxy = _compat.inductor.resolve_shape_to_proxy
    nc, nx, nl = counts

    def lowered(*flat):
        init, xs, lifted = _split(flat, nc, nx, nl)
        length = xs[0].size(0)
        symbols = {a.node.expr: a for a in (*flat, length) if isinstance(a, torch.SymInt)}
        ys = [torch.empty_strided(resolve_shape_to_proxy(v.size(), symbols),
                                  resolve_shape_to_proxy(v.stride(), symbols), dtype=v.dtype, device=v.device)
              for v in ys_vals]
        ny = len(ys)
        if not segments(length):  # no step: the bounds asserts would fail statically
            return [*(c.clone() for c in init), *ys]

        def cond(counter, *_rest):
            return counter < length

        def step(counter, *rest):
            bufs, carry, xs_, lifted_ = _split(rest, ny, nc, nx, nl)
            i = step_index(counter.item(), length, reverse=True)
            torch.ops.aten._assert_scalar.default(i >= 0, "scan: reverse index below 0")
            torch.ops.aten._assert_scalar.default(i < length, "scan: reverse index past the end")
            out = body(*carry, *(x.select(0, i) for x in xs_), *lifted_)
            for y, buf in zip(out[nc:], bufs):
                buf.select(0, i).copy_(y)
            return (counter + 1, *bufs, *out[:nc], *xs_)

        counter = torch.zeros([], dtype=torch.int64, device="cpu")
        res = torch.ops.higher_order.while_loop(cond, step, (counter, *ys, *init, *xs), tuple(lifted))
        return [*res[1 + ny:1 + ny + nc], *res[1:1 + ny]]

    return lowered
