"""Inductor code generation for scan's counted loops: which while_loops run as ``for`` loops, the
text passes over the generated wrappers as ONE declared pipeline per wrapper kind, and the C++
kernels some of them write, and the patches of inductor's private codegen that call them (its
modules and classes handed over by ``_compat.inductor``'s adapters).

May import: ``core``, ``_compat`` (nothing else of ``inductor``: ``lowering`` calls ``install``).

Modules:

- ``pipeline``: running a pipeline; a pass that cannot read the text (or raises) leaves the wrapper
  as generated with ONE ``WrapperPassWarning``; per-pass counts (``pass_counts``), a debug log
  (``torch_scan_hop.inductor.codegen``), ``passes_off``;
- ``passes``: THE two pipelines, ``PYTHON_WRAPPER`` and ``CPP_WRAPPER``, each pass with what it
  works on and the preconditions it checks;
- ``python_text``: the Python wrapper's passes (counter kernels and steps dropped, buffer pools,
  releases after finished loops);
- ``loop_kernel``: a Python loop whose body only calls C++ kernels, as ONE C++ kernel;
- ``kernel_build``: that kernel built as inductor builds its kernels but linked against libtorch
  only (``loop_kernel_link`` in ``pass_counts``), its binding without ``<sstream>``
  (``loop_kernel_binding``), compiled with ``kernel_header``'s precompiled header
  (``loop_kernel_header``), and waited for by its first call, not by the wrapper module's load;
- ``kernel_header``: inductor's precompiled ``cpp_prefix.h`` made once more (in the background) with
  the template instantiations GCC leaves pending at the end of a header done, by a GCC plugin's pragma;
- ``accumulate``: in such a kernel, a carried sum ``scan_blas_addmm`` accumulates (a weight
  gradient) accumulated in its own buffer (no copy of the old sum a step);
- ``carry_in_place``: in a counted loop left to Python, a carried sum an ``addmm`` accumulates (a
  weight gradient) written into the carry's own buffer (the loop owns it: its initial value copied
  once where the wrapper still reads it), not into a new buffer a step;
- ``cpp_text``: the C++ wrapper's passes (buffer pools, row views as pointers, mm as BLAS);
- ``blas``: float32 matmuls as ATen's own BLAS call (kernel sources, ATen's layout decisions);
- ``small_gemm``: those BLAS kernels' products by our AVX-512 gemm where MKL runs no AVX-512 (x86
  CPUs not Intel's: AMD EPYC's MKL path is AVX2, ~2.4x slower on the MLP's step matmul);
- ``fast_tanh``: float32 vector ``tanh`` in our loops' kernels, within 1 ulp at ~45% of Sleef's cost;
- ``counted_loops``: which loops are counted, and what their bodies read while generated;
- ``python_loop``: the Python wrapper's ``codegen_while_loop`` (and dynamic scalars, asserts) patched
  to write a counted loop as ``for``, and its generated text handed to the pipeline;
- ``cpp_loop``: the same for the C++ wrapper (inductor's own loop, three of its calls answered);
- ``triton_scan``: a scan body that is pointwise in its carries as the source of ONE Triton kernel with the
  time loop inside (``inductor.pointwise_scan`` runs it); ``triton_body`` translates the body, node by
  node, checking every value is a function of one element of the carry (sums into a smaller carry
  allowed: per-lane partials); ``triton_ops`` is its table of pointwise ops as Triton text;
- ``hooks``: ``install``, the patches above wired to the decisions and pipelines, and the patch of
  extern kernel calls that writes a planned matmul as a ``blas`` kernel call.

``pass_counts()`` holds, besides the text passes, ``python_for_loops`` / ``cpp_for_loops`` (a
while_loop of ours written as a counted loop, or left to inductor's loop) and
``blas_extern_calls`` (a matmul in such a loop written as a BLAS call, or left to ATen) and
``accumulate_in_place`` (a ``scan_blas_addmm`` of a loop run as one kernel accumulating in its own
buffer, or not) and ``fast_tanh`` (a vector ``tanh`` in such a loop's kernel written as
``fast_tanh``'s, or left to ATen's) and ``small_gemm`` (a BLAS call's product by our gemm, or by
``sgemm_``) and ``pointwise_scan_kernel`` (a CUDA scan node run as one Triton
kernel, or left to the loop lowering; ``passes_off("pointwise_scan_kernel")`` turns it off).

The patches of inductor that scan installs (``inductor.lowering.install``), as one table. Scan-only
(they act on our loops, whose subgraph names start with ``scan_loop_``, or on our operators):

    patch                                              acts on
    post-grad ``decompose_scan_to_while_loop``         graphs holding a scan node (others returned untouched)
    ``skip_input_asserts_of_subgraphs``                our loops' cond and body
    ``keep_loop_outputs_out_of_cuda_graphs``           our loops' outputs
    loop outputs unaligned (defect 8)                  our loops' outputs
    ``write_extern_outputs_into_rows`` (``copy_``)     our loop bodies' graphs
    ``skip_output_asserts_of(stacked_buffers)``        our operator's outputs
    ``hooks``: for loops, dynamic scalars, asserts,    our loops (and texts holding them)
    wrapper text passes, BLAS calls, vector ``tanh``

Global, each for a reason:

    patch                                  acts on              why it must be global
    ``SubgraphLowering.__init__``          every subgraph       a scan body's own subgraphs (a ``cond``, a
      donation indices cleared (defect 1)                       user's while_loop in it) inherit the same
                                                                wrong indices; pytorch#193960 does this
                                                                upstream; a subgraph never owns its inputs
    ``WhileLoop._clone_aliased_inputs``    every while_loop     a static method given only the carries (no
      copies realized (defect 3)                                name to tell ours by); torch 2.14 does this
    carried inputs never reused            every while_loop     a loop nested in a scan's body that could not
      (defect 5)                                                be named ours again (``lowering.
                                                                _rename_nested_loops``) is still a scan's; a
                                                                wrong reuse is a wrong gradient, keeping the
                                                                storage costs memory only
    ``WhileLoop.create``: mutated carries  every while_loop     runs before the loop (and its name) exists;
      in index order (defect 6)                                 sorted is what torch 2.9 and 2.15 do anyway
    ``can_reuse`` skips ``NonOwningLayout``  every graph        a scan body's buffers are planned in the
      views (``reuse_no_aliasing_buffers``)                     outer wrapper (inlined), which has no scan
                                                                name; reusing a view's storage (a slice of a
                                                                live buffer) is never right
    ``simplify_index_in_vec_range``        every vectorized     a body kernel's codegen has no name to tell
      returns a polynomial index as it is  C++ kernel index     ours by; there every index of xs holds a size
      (defect 9; speed only)               (before torch 2.15)  symbol (``x0 + 512*ks0``): ~6-10 ms of
                                                                ``sympy.simplify`` each; the stride read from
                                                                it is the same; torch 2.15 has no simplify
    ``codegen_allocation`` skips graph     every graph          only a ``NonOwningLayout`` over an input (our
      inputs                                                    row writes) reaches it; allocating a graph
                                                                input is never right (torch 2.14 skips it)
    fake rule: float64 flash attention's  float64 CPU          Dynamo fakes the body before anything knows
      logsumexp (defect 4)                 attention            it is a scan body; the rule gives the dtype
                                                                the real kernel returns
    C++ wrapper: compile tracking,         every compile, C++   the first records a flag only; the second is
      mutated carries named, reuse         while_loop, failed   torch 2.9's crash fix for any loop with mutated
      without a peak estimate              estimate             carries (a no-op where torch has it); the
                                                                third changes only a case that raised
"""
from .hooks import install  # noqa: F401
from .pipeline import WrapperPassWarning, pass_counts, passes_off, reset_pass_counts  # noqa: F401
