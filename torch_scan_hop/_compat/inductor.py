"""Inductor internals: the post-grad scan pass, its pattern matcher, and the
subgraph lowering that scan's while_loops go through.

Checked against torch 2.14's ``torch/_inductor``: ``post_grad`` still looks
``decompose_scan_to_while_loop`` up by name when its passes run, still has
``resolve_shape_to_proxy(shape, bound_symbols)`` (``inductor.lowering`` calls its core,
``sympy_interp``, through ``python_value_of``); ``PatternMatcherPass`` adds an optional ``subsystem``;
``SubgraphLowering.__init__`` still inherits the parent's ``bw_donated_idxs``
(the fix in ``inductor.workarounds`` is still needed).
``ir``, ``virtualized``, ``lowerings`` and ``free_symbols`` hand inductor's modules to the
lowering that writes a y into its row (``inductor.extern_rows``).
The C++ wrapper's adapters are in ``cpp_wrapper``.
"""
import functools


def post_grad_module():
    """``torch._inductor.fx_passes.post_grad`` (torch 2.9 to 2.15), whose
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
    are the pattern matcher's. torch 2.9 to 2.15: ``torch._inductor.pattern_matcher``
    (2.14's PatternMatcherPass takes an optional ``subsystem``, unused here)."""
    from torch._inductor.pattern_matcher import (
        CallFunctionVarArgs,
        PatternMatcherPass,
        register_graph_pattern,
    )

    pass_ = PatternMatcherPass()
    register_graph_pattern(CallFunctionVarArgs(target), extra_check=extra_check, pass_dict=pass_)(handler)
    return pass_


def python_value_of(expr, env):
    """The sympy expression ``expr`` computed in Python from ``env`` ({symbol: value}; traced
    SymInts give traced values), as upstream's scan decomposition sizes its ys. torch 2.9 to 2.15:
    ``torch.utils._sympy.interp.sympy_interp(PythonReferenceAnalysis, env, expr)``."""
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    return sympy_interp(PythonReferenceAnalysis, env, expr)


def run_after_subgraph_lowering_init(after):
    """Call ``after(lowering)`` at the end of every ``SubgraphLowering.__init__``
    (a while_loop's cond and body graphs are lowered by one). Not idempotent:
    call once. torch 2.9 to 2.15: ``torch._inductor.graph.SubgraphLowering``."""
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
    idempotent: call once. torch 2.9 to 2.15:
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
    ptrs are not allocated in pool" (torch 2.11, H200). Idempotent. torch 2.9 to 2.15:
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
    as a misaligned view (inductor's alignment assert failed, 3x5 float64). torch 2.9 to 2.15: ``PythonWrapperCodegen.can_reuse``.
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


def ir():
    """``torch._inductor.ir`` (torch 2.9 to 2.15: ``NonOwningLayout``, ``ExternKernelOut``,
    ``Reduction``, ``ComputedBuffer``, ``StorageBox``, ``InputBuffer``, ``BaseView``,
    ``FlexibleLayout``, ``FixedLayout``, ``ExternKernel.convert_to_reinterpret_view``)."""
    from torch._inductor import ir as ir_module

    return ir_module


def virtualized():
    """``torch._inductor.virtualized.V`` (``V.graph``: ``name``, ``current_node``, ``sizevars``,
    ``never_reuse_buffers``, ``mark_buffer_mutated``), torch 2.9 to 2.15."""
    from torch._inductor.virtualized import V

    return V


def lowerings():
    """Inductor's lowering table, ``{op: lowering}`` (``torch._inductor.lowering.lowerings``)."""
    from torch._inductor.lowering import lowerings as table

    return table


def free_symbols(expr, unbacked_only):
    """``torch._inductor.utils.get_free_symbols(expr, unbacked_only)`` (torch 2.9 to 2.15)."""
    from torch._inductor.utils import get_free_symbols

    return get_free_symbols(expr, unbacked_only)


def allocate_no_input_buffers():
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
    torch 2.9 to 2.15: ``ir.MultiOutput.skip_size_stride_alignment_checks``, its
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
