"""From a body to graphs: tracing, closure lifting, the joint, partitioning, caches.

- ``graph``: ``trace_graph``, the one entry for tracing a function to an aten graph;
- ``effects``: bodies traced without the host-side checks torch 2.14 made effects;
- ``lift``: closed-over tensors become explicit inputs (``additional_inputs``);
- ``closures``: the stand-ins a body reads for closed-over tensors while it is traced;
- ``flat_body``: the front end's body as the op sees it under Dynamo (and on copies of its carries,
  for a body that writes into them in place);
- ``closure_writes``: a body writing into a closed-over tensor, run with that tensor carried;
- ``copies``: a graph's ``aten.copy`` made differentiable where autograd runs the graph;
- ``indexing``: ``buf[:, t]`` and ``buf[:, t] = h`` with a 0-d integer tensor ``t`` traced as
  advanced indexing, not read as a Python int;
- ``stale_reads``: such a read (and a view of it) used after a write into its tensor, read again as
  the loop's view would show the write;
- ``body_checks``: a body traced for its input-mutation check (the checks: ``core/checks.py``);
- ``joint``: one step's joint forward/backward graph, traced from the user's own function;
- ``flag_reach``: the loop's requires-grad flags for fewer carries requiring grad, read off one
  joint's autograd graph instead of a trace per carry-flag state;
- ``partition``: the joint split into ``fwd`` / ``bwd`` (``FwdBwd``), by ``remat/partition.py``'s functions;
- ``peephole``: clean-ups of the partitioned graphs;
- ``shift``: saved carries read from the previous step's stack (one stacked buffer fewer per carry);
- ``cache``: reuse of partitions and lowerings, keyed by graphs (never by functions);
- ``example_values``: a scan's outputs for Dynamo's example value, with no autograd plan;
- ``same_branches``: a ``cond`` whose branches traced to one graph replaced by that graph;
- ``xla_formulas``: autograd formulas for torch_xla ops a joint meets.

May import: ``core``, ``_compat``.
"""
