"""XLA: the whole scan as one XLA ``While`` around the body's HLO.

- ``body``: one step of the body staged out as HLO on placeholder tensors;
- ``lower``: the While(s) built by the C++ extension (``torch_scan_hop._hlo_scan``,
  csrc/hlo_scan.cc) around it, cached per graph;
- ``conds``: a ``torch.cond`` in a body (``layers.alike``'s choice of a layer's code) staged as
  both branches and a select per output (one branch where the two are one graph);
- ``row_writes``: a carried buffer whose rows the body writes (``buf[t] = h``) written by the
  While in place, one iteration late;
- ``own_buffers``: the Whiles' constants and fill values in buffers of their own (a step's
  program then does not change with torch_xla's cache of scalar buffers);
- ``kept_ys``: opt-in (``SCAN_XLA_KEEP_YS=1``), the stacked ys buffers kept from step to step and
  updated in place (no fill, no fresh pages for them in each step's program);
- ``eager``: an eager scan on XLA tensors routed through Dynamo, whose guards say when
  the body is unchanged;
- ``mesh_texts``: SPMD meshes that keep their text, so Dynamo captures bodies that annotate shardings;
- ``sharding``: SPMD: each gradient leaves the scan with its tensor's sharding.

May import: ``core``, ``trace``, ``_compat``.
"""
