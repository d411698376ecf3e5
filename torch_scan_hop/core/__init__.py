"""What every layer of the package shares; imports only ``_compat``.

- ``trees``: pytree bookkeeping of ``scan``'s inputs and outputs, and ``ScanError`` with the
  messages for bad input (which leaf, which shape, what to do);
- ``schedule``: the loop schedule (step order, ``unroll`` blocks and remainder) every path runs;
- ``op_args``: the op's flat calling convention (examples to trace one step, output split);
- ``dtensors``: a DTensor as local tensor plus layout (public ``torch.distributed.tensor`` API).
"""
