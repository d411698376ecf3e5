"""Patches of inductor's wrapper codegen and scheduler for scan's loops, besides the numbered
defects (``workarounds``), the C++ wrapper (``cpp_wrapper``) and the counted loops
(``codegen``): per-call asserts left out where the loop lowering fixes the layouts, loop outputs
kept out of CUDA graphs, and two plans of buffers that were wrong for views (no reuse of a view's
storage, no allocation of a graph input). Installed by ``lowering`` (``extern_rows`` installs the
last); inductor's classes are ``_compat.inductor``'s adapters. Each says which torch it reads.
"""
from .. import _compat

_inductor = _compat.inductor


def skip_input_asserts_of_subgraphs(skipped):
    """Leave out the per-call input size/stride asserts of the subgraphs whose
    name ``skipped(name)`` accepts. A while_loop's cond and body are called once
    per iteration and assert every carried input each time (~1.3 us each,
    ~140 per decoder layer of a training step); their layouts are fixed by the
    while_loop lowering, and the outer graph still asserts its own inputs. Not
    idempotent: call once. torch 2.9 to 2.15: ``codegen.wrapper.SubgraphPythonWrapperCodegen``
    (with ``subgraph_name``), whose ``codegen_input_size_asserts`` is inherited."""
    subgraph_wrapper = _inductor.wrapper_codegen().SubgraphPythonWrapperCodegen
    asserts = subgraph_wrapper.codegen_input_size_asserts

    def codegen_input_size_asserts(self):
        if skipped(getattr(self, "subgraph_name", "")):
            return None
        return asserts(self)

    subgraph_wrapper.codegen_input_size_asserts = codegen_input_size_asserts


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
    ir, scheduler = _inductor.ir(), _inductor.scheduler()
    should_partition = scheduler.should_partition
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
    scheduler.should_partition = partition_loop_outputs


def reuse_no_aliasing_buffers():
    """Never hand a buffer that is a view of another (``NonOwningLayout``: a
    ``cat`` input written into its slice of the cat's buffer) on for reuse.
    Inductor's wrapper reuses a dead buffer's storage for a later one of the
    same size; for such a view that storage is a slice of a buffer still in
    use. In a scan body unrolled in blocks (its steps' values are
    concatenated) the block's new carry took the storage of a step's slice:
    it could overwrite the block's saved values, and the loop's carry came out
    as a misaligned view (inductor's alignment assert failed, 3x5 float64). torch 2.9 to 2.15:
    ``PythonWrapperCodegen.can_reuse``. Idempotent."""
    ir, python_wrapper = _inductor.ir(), _inductor.wrapper_codegen().PythonWrapperCodegen
    can_reuse = python_wrapper.can_reuse
    if getattr(can_reuse, "_scan_skips_views", False):
        return

    def reuse_unless_view(self, input_buffer, output_buffer=None):
        buffer = getattr(input_buffer, "node", input_buffer)  # a SchedulerBuffer or an ir.Buffer
        if isinstance(getattr(buffer, "layout", None), ir.NonOwningLayout):
            return False
        return can_reuse(self, input_buffer, output_buffer)

    reuse_unless_view._scan_skips_views = True
    python_wrapper.can_reuse = reuse_unless_view


def allocate_no_input_buffers():
    """torch 2.9's wrapper allocates the base of a ``NonOwningLayout`` view
    before aliasing it, also when that base is a graph input (a fresh
    ``empty_strided`` shadowing the input): skip input buffers, as torch
    2.14's ``PythonWrapperCodegen.codegen_allocation`` does. Idempotent."""
    ir, python_wrapper = _inductor.ir(), _inductor.wrapper_codegen().PythonWrapperCodegen
    allocate = python_wrapper.codegen_allocation
    if getattr(allocate, "_scan_skips_inputs", False):
        return

    def codegen_allocation(self, buffer):
        if isinstance(buffer, ir.InputBuffer):
            return None
        return allocate(self, buffer)

    codegen_allocation._scan_skips_inputs = True
    python_wrapper.codegen_allocation = codegen_allocation


def skip_output_asserts_of(op):
    """Leave out the size/stride and alignment asserts inductor writes after
    each output of a call to ``op`` (an OpOverload whose outputs are made
    exactly as its fake kernel says: our pool's ``stacked_buffers``, ~25
    outputs a training step, two asserts each, every call). Idempotent per op.
    torch 2.9 to 2.15: ``ir.MultiOutput.skip_size_stride_alignment_checks``, its
    producer being ``inputs[0]`` (a ``FallbackKernel`` with ``op_overload``)."""
    ir = _inductor.ir()
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
