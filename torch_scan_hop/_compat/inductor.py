"""Inductor internals: the post-grad scan pass, its pattern matcher, and the
subgraph lowering that scan's while_loops go through.

Checked against torch 2.14's ``torch/_inductor``: ``post_grad`` still looks
``decompose_scan_to_while_loop`` up by name when its passes run, still has
``resolve_shape_to_proxy(shape, bound_symbols)`` (ours calls its core,
``sympy_interp``); ``PatternMatcherPass`` adds an optional ``subsystem``;
``SubgraphLowering.__init__`` still inherits the parent's ``bw_donated_idxs``
(the fix in ``inductor.workarounds`` is still needed).
The C++ wrapper's adapters are in ``cpp_wrapper``.
"""
import functools

import sympy
import torch


def post_grad_module():
    """``torch._inductor.fx_passes.post_grad`` (torch 2.9-2.14), whose
    module-level pass functions are looked up by name each compile."""
    from torch._inductor.fx_passes import post_grad

    return post_grad


def run_before_scan_decomposition(before):
    """Make inductor's post-grad pass ``decompose_scan_to_while_loop`` call
    ``before(gm)`` first, then upstream's pass. Not idempotent: call once.

    Inductor has no hook for a pass ahead of its scan decomposition; the
    module attribute is replaced (``post_grad`` looks it up at run time on
    torch 2.9 and 2.14 alike)."""
    post_grad = post_grad_module()
    upstream = post_grad.decompose_scan_to_while_loop

    @functools.wraps(upstream)
    def decompose_scans(gm):
        before(gm)
        return upstream(gm)

    post_grad.decompose_scan_to_while_loop = decompose_scans


def call_pattern_pass(target, extra_check, handler):
    """A pattern pass (``.apply(gm)``) that calls ``handler(match, *args,
    **kwargs)`` for each ``call_function`` node of ``target`` passing
    ``extra_check(match)``; ``match.nodes`` and ``match.replace_by_example``
    are the pattern matcher's. torch 2.9-2.14: ``torch._inductor.pattern_matcher``
    (2.14's PatternMatcherPass takes an optional ``subsystem``, unused here)."""
    from torch._inductor.pattern_matcher import (
        CallFunctionVarArgs,
        PatternMatcherPass,
        register_graph_pattern,
    )

    pass_ = PatternMatcherPass()
    register_graph_pattern(CallFunctionVarArgs(target), extra_check=extra_check, pass_dict=pass_)(handler)
    return pass_


def resolve_shape_to_proxy(shape, symbols):
    """Sizes or strides with symbols replaced by traced values computed from
    ``symbols`` ({sympy expression: SymInt}), as upstream's scan decomposition
    preallocates its ys (``post_grad.resolve_shape_to_proxy``). A key may also be a
    compound expression whose symbols no input carries (xs made by ``cat([a, a])``:
    length ``2*s``): it is substituted as a whole first. torch 2.9-2.15:
    ``torch.utils._sympy.interp.sympy_interp(analysis, env, expr)``,
    ``torch.utils._sympy.reference.PythonReferenceAnalysis``."""
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    compound = {e: sympy.Dummy() for e in symbols if not e.is_symbol}
    env = {compound.get(e, e): v for e, v in symbols.items()}
    out = []
    for s in shape:
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            expr = compound[expr] if expr in compound else expr.subs(compound) if compound else expr
            out.append(sympy_interp(PythonReferenceAnalysis, env, expr))
        else:
            out.append(s)
    return out


def run_after_subgraph_lowering_init(after):
    """Call ``after(lowering)`` at the end of every ``SubgraphLowering.__init__``
    (a while_loop's cond and body graphs are lowered by one). Not idempotent:
    call once. torch 2.9-2.14: ``torch._inductor.graph.SubgraphLowering``."""
    from torch._inductor.graph import SubgraphLowering

    init = SubgraphLowering.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        after(self)

    SubgraphLowering.__init__ = __init__


def skip_input_asserts_of_subgraphs(skipped):
    """Leave out the per-call input size/stride asserts of the subgraphs whose
    name ``skipped(name)`` accepts. A while_loop's cond and body are called once
    per iteration and assert every carried input each time (~1.3 us each,
    ~140 per decoder layer of a training step); their layouts are fixed by the
    while_loop lowering, and the outer graph still asserts its own inputs. Not
    idempotent: call once. torch 2.9-2.14:
    ``torch._inductor.codegen.wrapper.SubgraphPythonWrapperCodegen`` (with
    ``subgraph_name``), whose ``codegen_input_size_asserts`` is inherited."""
    from torch._inductor.codegen.wrapper import SubgraphPythonWrapperCodegen

    asserts = SubgraphPythonWrapperCodegen.codegen_input_size_asserts

    def codegen_input_size_asserts(self):
        if skipped(getattr(self, "subgraph_name", "")):
            return None
        return asserts(self)

    SubgraphPythonWrapperCodegen.codegen_input_size_asserts = codegen_input_size_asserts


def keep_loop_outputs_out_of_cuda_graphs(ours):
    """With CUDA graphs (``mode="reduce-overhead"``), put the outputs of the while_loops
    whose body subgraph ``ours(name)`` accepts in the loop's own (not graphed) partition.
    A scan's loop runs outside CUDA graphs (its counter is a CPU tensor), and its outputs
    are views of buffers the loop wrote there; inductor put those views (``MultiOutput``s,
    GPU nodes) into a graphed partition of their own, whose outputs cudagraph trees then
    found neither in their memory pool nor aliasing a tensor input: "These storage data
    ptrs are not allocated in pool" (torch 2.11, H200). Idempotent. torch 2.9-2.15:
    ``Scheduler.should_partition(node)`` (a reason, or None where the node may be graphed),
    ``ir.MultiOutput.inputs[0]`` (the loop), ``ir.WhileLoop.body_subgraph.name``."""
    from torch._inductor import ir
    from torch._inductor.scheduler import Scheduler

    should_partition = Scheduler.should_partition
    if getattr(should_partition, "_scan_loops", False):
        return

    def partition_loop_outputs(self, node, *args, **kwargs):  # 2.9: should_log=
        reason = should_partition(self, node, *args, **kwargs)
        out = getattr(node, "node", None)
        if reason is None and isinstance(out, ir.MultiOutput) and out.inputs:
            loop = out.inputs[0]
            if isinstance(loop, ir.WhileLoop) and ours(loop.body_subgraph.name):
                return "a scan loop's outputs (the loop runs outside CUDA graphs)"
        return reason

    partition_loop_outputs._scan_loops = True
    Scheduler.should_partition = partition_loop_outputs


def reuse_no_aliasing_buffers():
    """Never hand a buffer that is a view of another (``NonOwningLayout``: a
    ``cat`` input written into its slice of the cat's buffer) on for reuse.
    Inductor's wrapper reuses a dead buffer's storage for a later one of the
    same size; for such a view that storage is a slice of a buffer still in
    use. In a scan body unrolled in blocks (its steps' values are
    concatenated) the block's new carry took the storage of a step's slice:
    it could overwrite the block's saved values, and the loop's carry came out
    as a misaligned view (inductor's alignment assert failed, 3x5 float64). torch 2.9-2.14: ``PythonWrapperCodegen.can_reuse``.
    Idempotent."""
    from torch._inductor import ir
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    can_reuse = PythonWrapperCodegen.can_reuse
    if getattr(can_reuse, "_scan_skips_views", False):
        return

    def reuse_unless_view(self, input_buffer, output_buffer=None):
        buffer = getattr(input_buffer, "node", input_buffer)  # a SchedulerBuffer or an ir.Buffer
        if isinstance(getattr(buffer, "layout", None), ir.NonOwningLayout):
            return False
        return can_reuse(self, input_buffer, output_buffer)

    reuse_unless_view._scan_skips_views = True
    PythonWrapperCodegen.can_reuse = reuse_unless_view


def write_extern_outputs_into_rows(in_scan_body):
    """In a graph that ``in_scan_body(name)`` accepts, lower ``row.copy_(y)``
    (``row`` a view of an input buffer: a scan's ys buffer) by letting ``y``'s
    extern kernel (``extern_kernels.mm``/``addmm``/``bmm``: every weight
    gradient of a training backward, saved matmul outputs) or reduction
    kernel write the row itself, as inductor does for the inputs of a ``cat``:
    the output buffer becomes a non-owning view of the row. Anywhere else, and where
    that is not exactly a copy (``_extern_output_into``), inductor's own
    ``copy_`` lowering runs unchanged. Not idempotent: call once.
    torch 2.9-2.15: ``lowering.lowerings``, ``ir.NonOwningLayout``,
    ``ir.ExternKernelOut``, ``ir.Reduction``, ``ir.ComputedBuffer``,
    ``V.graph.never_reuse_buffers``."""
    import torch
    from torch._inductor.lowering import lowerings
    from torch._inductor.virtualized import V

    op = torch.ops.aten.copy_.default
    copy_ = lowerings[op]
    _allocate_no_input_buffers()

    def copy_into_row(dst, src, non_blocking=False):
        if in_scan_body(getattr(V.graph, "name", None) or "") and _extern_output_into(dst, src):
            return dst
        return copy_(dst, src, non_blocking)

    lowerings[op] = copy_into_row


def _extern_output_into(dst, src):
    """Make ``src``'s extern kernel write ``dst`` directly when that is the
    same as copying it there; True if done."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    node = V.graph.current_node
    if node is None or len(node.args) < 2 or any(u.op == "output" for u in getattr(node.args[1], "users", ())):
        return False  # a y that is also a carry must not alias the ys buffer
    row = _row_view(dst)
    kernel = _extern_kernel_of(src)
    if row is None or kernel is None:
        return False
    base = row.data.data
    if base.get_name() in kernel.get_read_names():
        return False
    lay, rlay, sv = kernel.layout, row.layout, V.graph.sizevars

    def equal(a, b):
        return len(a) == len(b) and all(sv.statically_known_equals(p, q) for p, q in zip(a, b))

    dense = ir.FlexibleLayout.contiguous_strides(rlay.size)
    if not (lay.dtype == rlay.dtype and lay.device == rlay.device and equal(lay.size, rlay.size)
            and equal(rlay.stride, dense) and sv.statically_known_equals(lay.offset, 0)
            and (isinstance(lay, ir.FlexibleLayout) or equal(lay.stride, rlay.stride))):
        return False  # not the whole output, or not dense in the row's layout
    if type(kernel) is ir.ComputedBuffer and sympy.Mod(rlay.offset * rlay.dtype.itemsize, 16) != 0:
        return False  # a kernel's output must start 16-byte aligned (torch 2.15's while_loop checks it)
    kernel.layout = ir.NonOwningLayout(row)
    V.graph.never_reuse_buffers.add(kernel.get_name())  # its storage is the row: never handed on
    V.graph.mark_buffer_mutated(base.get_name())
    _also_uses_symbols_of(kernel, rlay.offset)
    return True


def _row_view(dst):
    """``dst`` (a TensorBox) as a ReinterpretView of an input buffer, or None."""
    from torch._inductor import ir

    data = getattr(dst, "data", None)
    if not isinstance(data, ir.BaseView):
        return None
    try:
        view = ir.ExternKernel.convert_to_reinterpret_view(data)
    except Exception:  # noqa: BLE001 - not strides over one buffer: copy as usual
        return None
    box = view.data
    if not (isinstance(box, ir.StorageBox) and isinstance(box.data, ir.InputBuffer)):
        return None
    return view


def _extern_kernel_of(src):
    """The buffer that is the whole of ``src``, its layout still its own (not yet
    aliased elsewhere): a plain extern kernel call, or a reduction (realized here:
    a ``y = c.sum(-1)`` was computed into a buffer of its own and copied into the
    row, an allocation and a copy per step), else None. An unrealized pointwise
    ``src`` needs none of this: inductor's ``copy_`` computes it into the row."""
    from torch._inductor import ir

    box = getattr(src, "data", None)
    if not isinstance(box, ir.StorageBox):
        return None
    if isinstance(box.data, ir.Reduction):
        box.realize()
    kernel = box.data
    if type(kernel) is ir.ExternKernelOut and type(kernel.layout) in (ir.FixedLayout, ir.FlexibleLayout):
        return kernel
    if type(kernel) is ir.ComputedBuffer and type(kernel.layout) is ir.FlexibleLayout:
        return kernel
    return None


def _also_uses_symbols_of(kernel, offset):
    """The kernel now writes at an offset of the loop index (an unbacked
    symbol): the scheduler must place it after the index is read, and it only
    orders kernels by the symbols they use."""
    from torch._inductor.utils import get_free_symbols

    if not get_free_symbols(offset, unbacked_only=True):
        return
    uses = kernel.get_free_symbol_uses

    def get_free_symbol_uses(unbacked_only=False):
        return uses(unbacked_only) | get_free_symbols(offset, unbacked_only)

    kernel.get_free_symbol_uses = get_free_symbol_uses


def _allocate_no_input_buffers():
    """torch 2.9's wrapper allocates the base of a ``NonOwningLayout`` view
    before aliasing it, also when that base is a graph input (a fresh
    ``empty_strided`` shadowing the input): skip input buffers, as torch
    2.14's ``PythonWrapperCodegen.codegen_allocation`` does. Idempotent."""
    from torch._inductor import ir
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    allocate = PythonWrapperCodegen.codegen_allocation
    if getattr(allocate, "_scan_skips_inputs", False):
        return

    def codegen_allocation(self, buffer):
        if isinstance(buffer, ir.InputBuffer):
            return None
        return allocate(self, buffer)

    codegen_allocation._scan_skips_inputs = True
    PythonWrapperCodegen.codegen_allocation = codegen_allocation


def skip_output_asserts_of(op):
    """Leave out the size/stride and alignment asserts inductor writes after
    each output of a call to ``op`` (an OpOverload whose outputs are made
    exactly as its fake kernel says: our pool's ``stacked_buffers``, ~25
    outputs a training step, two asserts each, every call). Idempotent per op.
    torch 2.9-2.14: ``ir.MultiOutput.skip_size_stride_alignment_checks``, its
    producer being ``inputs[0]`` (a ``FallbackKernel`` with ``op_overload``)."""
    from torch._inductor import ir

    codegen = ir.MultiOutput.codegen
    skipped = getattr(codegen, "_scan_skipped_ops", None)
    if skipped is None:
        skipped = set()

        def multi_output_codegen(self, wrapper):
            producer = self.inputs[0] if self.inputs else None
            if getattr(producer, "op_overload", None) in skipped:
                self.skip_size_stride_alignment_checks = True
            return codegen(self, wrapper)

        multi_output_codegen._scan_skipped_ops = skipped
        ir.MultiOutput.codegen = multi_output_codegen
    skipped.add(op)
