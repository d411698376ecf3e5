"""Remat: what each scan step keeps for its backward, and how the rest comes back.

One policy object drives every path, so the remat code lives together, by what it serves:

- ``policies``: the policies as plain objects (``RematPolicy``, ``checkpoint_name``,
  ``dots_saveable``, ``save_only_these_names``, the strings and ``("binomial", k)``) and their
  one validator (``validated``);
- ``step``: a step with its policy applied, what the eager loop runs (``op/loop.py``);
- ``replay``: the eager replay engine, one per scan (``StepReplay``);
- ``selective_replay``: its half for the selective policies (kept op outputs, named values);
- ``writes``: steps writing into tensors from outside the step, found and run as the plain loop;
- ``sac_replay``: selective checkpointing whose saved values replay (a second backward);
- ``recipes``: recipes recorded per call, so saved values are recomputed without re-running the body;
- ``keep``: which recorded values an eager ``"min_cut"`` step keeps within its memory budget;
- ``policy_ops``: which recorded calls an op-level ``RematPolicy`` keeps the outputs of;
- ``revolve``: binomial checkpointing's schedule for ``("binomial", k)``;
- ``partition``: the policies as AOTAutograd partition functions for traced steps
  (``trace/partition.py`` calls them).

May import: ``core``, ``_compat`` (its floor is between them and ``trace``, which imports it).
"""
