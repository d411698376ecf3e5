"""Inductor: scan nodes lowered to ``while_loop`` (``lowering``, reverse in place), the
reused storage of stacked buffers (``buffer_pool``), a ``y`` written straight into its row of
the ys (``extern_rows``), a carried buffer whose rows the body writes written in place
(``row_writes``), torch defects worked around (``workarounds``), the other patches of
inductor's wrapper codegen and scheduler for scan's loops (``wrapper_patches``), the C++ wrapper:
whether a graph gets one, and its while_loop defects (``cpp_wrapper``), and the code generated for
counted loops (``codegen/``); on CUDA, a scan whose body is pointwise in its carries as ONE Triton
kernel with the time loop inside, forward and backward (``pointwise_scan``: the post-grad pass that
runs first and the operator taking the kernel's source). The private inductor modules and classes these patch or read come
from ``_compat.inductor``'s adapters.

May import: ``core``, ``_compat``.
"""
