"""Workarounds for nine torch defects that scan's inductor loops hit (2.9; 5 and 8 also 2.15; 6 in
2.10-2.11; 7 in 2.9-2.11; 9 before 2.15).

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

5. A carried input's storage reused while the loop's output is that input. The
   wrapper frees a while_loop's carried input after the loop (its last use) and
   hands its storage to a later buffer of the same size; but the loop's output IS
   that input when the body returns it unchanged (a closure's gradient
   accumulator in a backward whose body does not differentiate the closure:
   ``argmax(x * w)``) or runs no iteration. With ``unroll`` the remainder loop's
   ys took that storage: the closure's gradient came out as a row of x's
   gradient (fuzz seed 9001, torch 2.9 and 2.15). Carried inputs are never reused.

6. Mutated carries paired with the wrong outputs. ``WhileLoop.create`` walks the list
   of carries the body mutates in step with the body's outputs; torch 2.10-2.11 list
   them in the order the body writes them, and a scan's body writes its ys rows before
   it steps its counter, so the scan's ys came back as the counter (torch 2.11, every
   compiled scan with ys). ``create`` gets that list in index order.

7. Strided loop inputs with symbolic strides. Under ``dynamic=True`` a scan along another
   dim than 0 has xs whose strides are symbolic and not the contiguous ones (a movedim of
   the user's tensor). torch 2.9-2.11 generated a backward loop body that read the rows of
   such xs wrongly when it recomputed a step with softmax and flip of them: every gradient
   through the carry was wrong (fuzz seed 910003; right with static shapes, with contiguous
   xs, and on torch 2.15). Before torch 2.15 such xs are copied contiguous first (one copy
   per call, as big as xs).

8. Loop outputs asserted aligned that are views at an offset. A body may return as its new
   carry a view into a buffer of its own at a storage offset: a slice of a concatenation
   (``cat([a, b])[1:]``; a DTensor body gathers an uneven shard padded and slices it), which
   inductor writes in place. The loop's outputs are those views, and the wrapper asserted
   each 16-byte aligned ("Expect the tensor to be 16 bytes aligned", torch 2.9, 2.11, 2.15;
   found by a random DTensor body on 2 ranks, where it failed one rank only and the other
   then waited in its next collective). Our loops' outputs count as unaligned buffers: no
   assert, and no kernel reading them assumes alignment.

9. A slow analysis of every vectorized index (speed, not values). Before it vectorizes a loop,
   torch 2.9's C++ codegen asks each index's stride in the vector lane (``stride_at_vec_range``),
   first rewriting the index's ``FloorDiv`` / ``ModularIndexing`` of the lane variable and then
   running ``sympy.simplify`` on the whole index: ~6-10 ms for an index holding a size symbol,
   which every kernel of a loop body has (its row of xs: ``x0 + 512*ks0``, ks0 the step), ~0.05 s
   CPU of the tanh RNN's first compiled call. torch 2.15 no longer runs that ``simplify``. For a
   polynomial index (``is_polynomial()``: no floor division, modulus or other function), which
   the rewrite leaves as it is, the index is returned unsimplified: its only reader,
   ``stride_at(index, var)``, simplifies ``index(var + 1) - index``, the same number either way.
   Others go to torch's function. Global (every CPU kernel; only the time changes).
"""
import contextlib

import torch

from .. import _compat

_inductor = _compat.inductor
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
    """Defect 3: the copies ``WhileLoop._clone_aliased_inputs`` gives carries that share a
    buffer are realized buffers. Idempotent; a no-op where they already are (torch 2.14).
    torch 2.9 to 2.15: ``ir.WhileLoop._clone_aliased_inputs(carried)`` (a staticmethod),
    ``ir.ExternKernel.copy_input``, ``ir.is_storage_and_layout``."""
    ir = _inductor.ir()
    clone_aliased = ir.WhileLoop._clone_aliased_inputs
    if getattr(clone_aliased, "_scan_realized", False):
        return

    def clone_aliased_inputs(carried_inputs):
        result = clone_aliased(carried_inputs)
        return [new if new is old or ir.is_storage_and_layout(new) else ir.ExternKernel.copy_input(old)
                for new, old in zip(result, carried_inputs)]

    clone_aliased_inputs._scan_realized = True
    ir.WhileLoop._clone_aliased_inputs = staticmethod(clone_aliased_inputs)


def _visit_while_outputs(tag, visit):
    """Wrap ``ir.WhileLoop.create`` so that ``visit(loop, output)`` runs for each output of each
    loop it makes; ``tag`` marks the wrapper, so a second call with the same tag is a no-op.
    torch 2.9 to 2.15: ``ir.WhileLoop.create`` is a classmethod returning the loop's
    ``MultiOutput``s, whose ``inputs[0]`` is the loop."""
    ir = _inductor.ir()
    create = ir.WhileLoop.create.__func__
    if getattr(create, tag, False):
        return

    def create_visited(cls, *args, **kwargs):
        outputs = create(cls, *args, **kwargs)
        for out in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
            loop = out.inputs[0] if isinstance(out, ir.MultiOutput) else None
            if isinstance(loop, ir.WhileLoop):
                visit(loop, out)
        return outputs

    setattr(create_visited, tag, True)
    ir.WhileLoop.create = classmethod(create_visited)


def keep_carried_inputs_unreused():
    """Defect 5: put the buffers a ``WhileLoop`` carries in (and their views' buffers) in
    ``V.graph.never_reuse_buffers``: a loop output is its carried input when the body
    returns that input unchanged, or runs no iteration, so that storage must not be
    handed on when the input's last use (the loop) is over. Idempotent.
    torch 2.9 to 2.15: a loop's ``carried_inputs`` are realized buffers or views,
    ``V.graph.never_reuse_buffers``."""
    V = _inductor.virtualized()

    def unreused(loop, _out):
        for inp in loop.carried_inputs or ():
            V.graph.never_reuse_buffers.add(inp.get_name())

    _visit_while_outputs("_scan_unreused", unreused)


def mark_loop_outputs_unaligned(ours):
    """Defect 8: put the outputs of the ``WhileLoop``s whose body subgraph's name ``ours(name)``
    accepts in ``V.graph.unaligned_buffers``: the wrapper then asserts no alignment for them, and
    the kernels that read them assume none. Idempotent. torch 2.9 to 2.15:
    ``WhileLoop.body_subgraph.name``, ``V.graph.unaligned_buffers`` (read by
    ``codegen_alignment_asserts``)."""
    V = _inductor.virtualized()

    def unaligned(loop, out):
        if ours(loop.body_subgraph.name):
            V.graph.unaligned_buffers.add(out.get_name())

    _visit_while_outputs("_scan_unaligned", unaligned)


def pair_mutated_carries_by_index():
    """Defect 6: give ``WhileLoop.create`` the carries its body mutates in index order.
    Idempotent. torch 2.9-2.11's ``create`` pairs each mutated carry with its output by walking
    that list in order; from 2.10 on ``check_input_alias_and_mutation`` lists them in the order
    the body's ops write them (2.9 sorted them), so a body writing carry 1 before carry 0 gave
    output 1 carry 0's buffer (2.11: a scan's ys came back as its loop counter). torch 2.15 takes ``all_inputs[idx]`` itself.
    Sorting is what 2.9 returned. torch 2.9 to 2.15: ``check_input_alias_and_mutation(gm,
    fake_args)`` (maps, mutated indices) of ``_compat.hop.utils_module()``, looked up there by
    ``ir.WhileLoop.create`` when it runs."""
    ir, hop_utils = _inductor.ir(), _compat.hop.utils_module()
    create = ir.WhileLoop.create.__func__
    if getattr(create, "_scan_sorted", False):
        return

    def create_sorted(cls, *args, **kwargs):
        check = hop_utils.check_input_alias_and_mutation

        def sorted_check(*a, **k):
            *maps, mutated = check(*a, **k)
            return (*maps, sorted(set(mutated)))

        hop_utils.check_input_alias_and_mutation = sorted_check
        try:
            return create(cls, *args, **kwargs)
        finally:
            hop_utils.check_input_alias_and_mutation = check

    create_sorted._scan_sorted = True
    ir.WhileLoop.create = classmethod(create_sorted)


def keep_polynomial_vec_indices_unsimplified():
    """Defect 9: torch 2.9's ``simplify_index_in_vec_range`` returns a polynomial index as it is
    (no ``sympy.simplify``). Idempotent; nothing where the codegen module does not define it
    (torch 2.15). Before torch 2.15: ``_compat.inductor.cpp_codegen()``'s
    ``simplify_index_in_vec_range`` (an ``lru_cache``), a module global of its callers."""
    cpp = _inductor.cpp_codegen()
    simplify = getattr(cpp, "simplify_index_in_vec_range", None)
    if simplify is None or getattr(simplify, "_scan_polynomial", False):
        return

    def polynomial_unsimplified(index, var, vec_length):
        if index.is_polynomial() is True:
            return index
        return simplify(index, var, vec_length)

    polynomial_unsimplified._scan_polynomial = True
    polynomial_unsimplified.__wrapped__ = simplify
    polynomial_unsimplified.cache_clear = getattr(simplify, "cache_clear", lambda: None)
    cpp.simplify_index_in_vec_range = polynomial_unsimplified


def fake_float64_attention_logsumexp_as_float64():
    """Defect 4: where FakeTensorMode fakes a float64 CPU flash attention's logsumexp
    as float32, a fake rule gives it as float64 (for float64 queries only)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with _compat.FakeTensorMode():
        q = torch.empty(1, 1, 2, 4, dtype=torch.float64)
        if op(q, q, q)[1].dtype == torch.float64:
            return

    def float64_query(args, kwargs):
        return (args[0] if args else kwargs["query"]).dtype == torch.float64

    def logsumexp_as_float64(outs, args, kwargs):
        out, lse = outs
        return out, torch.empty_strided(lse.size(), lse.stride(), dtype=torch.float64, device=lse.device)

    _add_fake_rule("float64 attention logsumexp", op, float64_query, logsumexp_as_float64)


def _add_fake_rule(name, op, applies, adjust):
    """Under FakeTensorMode, for calls of ``op`` where ``applies(args, kwargs)``: run its
    meta kernel, then return ``adjust(meta_outputs, args, kwargs)`` (meta tensors) as
    fakes on the inputs' device. Once per ``name``; clears the fake dispatch cache
    (results cached before may be stale). torch 2.9 to 2.15: the rules FakeTensorMode
    consults before meta kernels (``_compat.tracing.fake_rule_checks``), the kernel
    invocation context (``_compat.tracing.in_kernel_invocation``), ``FakeTensor(mode, meta,
    device)``, ``FakeTensorMode.cache_clear``."""
    checks = _compat.tracing.fake_rule_checks()
    if any(getattr(rule, "_scan_rule", None) == name for _, rule in checks):
        return

    def rule(fake_mode, func, *args, **kwargs):
        if not applies(args, kwargs):
            return NotImplemented
        device = next(t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        with _compat.tracing.in_kernel_invocation(fake_mode):
            outs = adjust(func(*args, **kwargs), args, kwargs)
        return tuple(_compat.FakeTensor(fake_mode, t, device) for t in outs)

    rule._scan_rule = name
    checks.append((lambda func: func is op, rule))
    _compat.FakeTensorMode.cache_clear()


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


_STRIDED_XS_MISREAD = torch.__version__ < (2, 15)  # defect 7


def _symbolically_strided(val):
    """Defect 7's xs: symbolic strides that are not known to be the contiguous ones."""
    return (_STRIDED_XS_MISREAD and isinstance(val, torch.Tensor)
            and not all(isinstance(st, int) for st in val.stride()) and not _known_contiguous(val))


def materialize_expanded_operands(gm):
    """Give every scan node a dense copy of each expanded init or xs input (defect 2) and,
    before torch 2.15, of each xs input strided with symbolic strides (defect 7)."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan):
        combine, init, xs, *rest = node.args
        with gm.graph.inserting_before(node):
            init = [_contiguous_copy(gm.graph, n) if _is_expanded(n.meta.get("val")) else n for n in init]
            xs = [_contiguous_copy(gm.graph, n) if _is_expanded(n.meta.get("val"))
                  or _symbolically_strided(n.meta.get("val")) else n for n in xs]
        node.args = (combine, init, xs, *rest)
    gm.graph.lint()


def _known_contiguous(t):
    """``t``'s strides are known, without a guard, to be the contiguous ones of its sizes
    (a tensor with symbolic sizes: each stride compared as a symbolic expression)."""
    statically_known_true = _compat.tracing.statically_known_true
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not statically_known_true(size <= 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True
