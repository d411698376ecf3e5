"""Whole models: ``scan_model`` runs a transformers model's decoder stack as scans.

- ``scan_model``: the front end (finds the base model and its layers, prepares the plan);
- ``forward_loop``: reads the model's forward (its ``ast``) to check that its loop over the
  layers only calls each layer on the hidden state;
- ``deferred``: the container and stand-ins that record the loop's calls and run the stack as
  ``scan_layers(..., period="auto")`` when the last layer is called.
- ``stacked_cache``: transformers' static and dynamic KV caches as per-layer rows of a traced
  scan (a compiled decode step is one scan);
- ``linear_cache``: the same for their linear-attention layers (Qwen3-Next's conv and
  recurrent states).

May import: ``layers``, ``api``, ``op``, ``core``, ``_compat``.
"""
from .scan_model import scan_model, scan_plan

__all__ = ["scan_model", "scan_plan"]
