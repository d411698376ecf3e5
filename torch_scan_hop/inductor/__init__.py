"""Inductor: scan nodes lowered to ``while_loop`` (``lowering``, reverse in place), the
reused storage of stacked buffers (``buffer_pool``), a ``y`` written straight into its row of
the ys (``extern_rows``), and torch 2.9 defects worked around (``workarounds``; their
private-API mechanics are in ``_compat``).

May import: ``core``, ``_compat``.
"""
