"""What every layer of the package shares; imports only ``_compat``.

- ``trees``: pytree bookkeeping of ``scan``'s inputs and outputs, and ``ScanError`` with the
  messages for bad input (which leaf, which shape, what to do);
- ``checks``: what every step's output must satisfy (the carry keeps init's structure, shape
  and dtype; no input mutated), one message each, for the pytree front end and the flat op;
- ``route``: which path a scan takes (the eager loop, Dynamo, XLA's eager entry or the op),
  decided in one place;
- ``modes``: which dispatch modes and tensors mean a tracer is at work (``runs_eagerly``);
- ``trace_lock``: this package's traces serialized across threads (``tracing_lock``), whether a
  make_fx trace is this thread's (``under_make_fx``), and the FX sources they leave bounded;
- ``schedule``: the loop schedule (step order, ``unroll`` blocks and remainder) every path runs;
- ``op_args``: the op's flat calling convention (examples to trace one step, output split);
- ``step_index``: ``scan(..., with_index=True)``'s step index, an ``arange`` scanned as one more xs leaf;
- ``sym_sizes``: symbolic sizes computed again from SymInts a trace holds (``KnownSizes``);
- ``dtensors``: a DTensor as local tensor plus layout (public ``torch.distributed.tensor`` API);
- ``torch_xla_keywords``: torch_xla's scan keywords (``partition_fn``, ``is_fn_pure``) mapped
  onto ours;
- ``aten_nodes``: what an ATen call in a traced graph does to its inputs (graph passes ask);
- ``grad_reach``: whether a tensor requiring grad is within reach of a body's closures;
- ``drain``: autograd work a failed backward leaves queued, freed while Python still runs.

(Remat, what a step keeps for its backward, is the ``remat`` folder above this one.)
"""
