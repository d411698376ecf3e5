"""Workarounds for four torch 2.9 defects that scan's inductor loops hit.

1. Subgraph inputs taken as donated buffers (fixed upstream by pytorch#193960).
   Compiling a backward graph, inductor marks the inputs listed in AOT's
   ``bw_donated_idxs`` as donated: their storage may be reused for the graph's
   own results. ``SubgraphLowering`` (a while_loop's cond and body) inherited
   those indices and applied them to its OWN placeholders, an unrelated
   numbering. A loop body then wrote its new carry into the storage of a
   carried input, so the loop's result aliased that input; the outer graph,
   seeing the input's last use, reused its storage for a later buffer (the next
   loop's preallocated ys) and the result was overwritten: wrong closure
   gradients whenever the backward has two loops (``unroll`` blocks plus a
   remainder) and buffer sizes happen to match.

2. Expanded loop operands. ``WhileLoop.create`` asks every operand for its
   exact strides; for a stride-0 dim (``expand``, e.g. the gradient of
   ``ys.sum()``) ``require_strides`` calls ``slice_`` on an unwrapped view and
   asserts. A scan's init and xs are while_loop operands, so a training step
   whose loss is ``carry.sum() + ys.sum()`` failed to compile. Such operands are
   materialized (a contiguous clone, as big as the expanded tensor) first.

3. Two carries from one buffer. ``WhileLoop._clone_aliased_inputs`` gives the
   second of two carries that share a buffer a ``clone``, left unrealized; for
   a 0-dim carry nothing realizes it later and asking its strides raises
   ``NotImplementedError: Pointwise``. Hit by ``scan(f, (s, s), xs)`` and by a
   backward whose two 0-dim carry gradients start as the same zero. Such
   clones are realized copies (what torch 2.14's ``ExternKernel.copy_input``
   there does).

4. A float64 attention's logsumexp, faked as float32. torch 2.9's fake kernel of
   ``aten._scaled_dot_product_flash_attention_for_cpu`` says float32 where the
   CPU kernel returns float64 (torch 2.14 says float64). A compiled loop passes
   the real tensor on; a scan copies each step's values into a stacked buffer
   made from the fake, and generated code read the float64 values as float32
   (then the backward stopped: "expected scalar type Double but found Float").
   FakeTensorMode gets the real dtype for float64 inputs; others are untouched.
   Installed on import: Dynamo fakes the body before inductor runs.
"""
import contextlib

import torch

from . import _compat

_subgraph_fix_installed = False


def keep_subgraph_inputs_undonated():
    """Subgraphs own none of their inputs: clear the inherited donation indices
    (what pytorch#193960 does in ``SubgraphLowering.__init__``). Idempotent."""
    global _subgraph_fix_installed
    if _subgraph_fix_installed:
        return

    def undonate(lowering):
        lowering.bw_donated_idxs = None

    _compat.inductor.run_after_subgraph_lowering_init(undonate)
    _subgraph_fix_installed = True


def realize_copies_of_aliased_carries():
    """Make the copies ``WhileLoop._clone_aliased_inputs`` gives aliased carries
    realized buffers (defect 3). Idempotent; a no-op where the copies already are
    (torch 2.14). torch 2.9-2.14: ``ir.WhileLoop._clone_aliased_inputs(carried)``,
    ``ir.ExternKernel.copy_input``, ``ir.is_storage_and_layout``."""
    from torch._inductor import ir

    clone_aliased = ir.WhileLoop._clone_aliased_inputs
    if getattr(clone_aliased, "_scan_realized", False):
        return

    def clone_aliased_inputs(carried_inputs):
        result = clone_aliased(carried_inputs)
        return [new if new is old or ir.is_storage_and_layout(new) else ir.ExternKernel.copy_input(old)
                for new, old in zip(result, carried_inputs)]

    clone_aliased_inputs._scan_realized = True
    ir.WhileLoop._clone_aliased_inputs = staticmethod(clone_aliased_inputs)


def fake_float64_attention_logsumexp_as_float64():
    """Defect 4: where FakeTensorMode fakes a float64 CPU flash attention's logsumexp
    as float32, register a fake rule returning it as float64. Idempotent. torch
    2.9: ``fake_impls.op_implementations_checks`` (consulted before meta kernels),
    ``fake_tensor.in_kernel_invocation_manager``, ``FakeTensor(mode, meta, device)``."""
    from torch._subclasses import fake_impls

    if any(getattr(impl, "_scan_float64_lse", False) for _, impl in fake_impls.op_implementations_checks):
        return
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if _faked_logsumexp_dtype(op) == torch.float64:
        return

    def fake_attention(fake_mode, func, *args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

        query = args[0] if args else kwargs["query"]
        if query.dtype != torch.float64:
            return NotImplemented
        with in_kernel_invocation_manager(fake_mode):
            out, lse = func(*args, **kwargs)
            lse = torch.empty_strided(lse.size(), lse.stride(), dtype=query.dtype, device="meta")
        return FakeTensor(fake_mode, out, query.device), FakeTensor(fake_mode, lse, query.device)

    fake_attention._scan_float64_lse = True
    fake_impls.op_implementations_checks.append((lambda func: func is op, fake_attention))
    _compat.FakeTensorMode.cache_clear()  # results cached before (the probe's among them) are stale


def _faked_logsumexp_dtype(op):
    with _compat.FakeTensorMode():
        q = torch.empty(1, 1, 2, 4, dtype=torch.float64)
        return op(q, q, q)[1].dtype


def _is_expanded(val):
    """A stride-0 dim that is not statically of size 1 (inductor's test)."""
    return isinstance(val, torch.Tensor) and any(
        isinstance(st, int) and st == 0 and not (isinstance(sz, int) and sz <= 1)
        for sz, st in zip(val.shape, val.stride()))


def _contiguous_copy(graph, node):
    clone = graph.call_function(torch.ops.aten.clone.default, (node,),
                                {"memory_format": torch.contiguous_format})
    val = node.meta["val"]
    with getattr(val, "fake_mode", None) or contextlib.nullcontext():
        clone.meta["val"] = val.clone(memory_format=torch.contiguous_format)
    return clone


def materialize_expanded_operands(gm):
    """Give every scan node a dense copy of each expanded init or xs input."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan):
        combine, init, xs, *rest = node.args
        with gm.graph.inserting_before(node):
            init, xs = ([_contiguous_copy(gm.graph, n) if _is_expanded(n.meta.get("val")) else n for n in group]
                        for group in (init, xs))
        node.args = (combine, init, xs, *rest)
    gm.graph.lint()

