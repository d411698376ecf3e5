"""Selective activation checkpointing's modes (``torch.utils.checkpoint`` with a
``context_fn`` from ``create_selective_checkpoint_contexts``) under a tracer.

On real tensors the op never reaches these modes: it runs as the loop before
dispatch (``op.hop``), so the policy sees each body op as in a for loop. Traced
(``torch.compile`` of a checkpointed region) the scan is one node: the modes
see it as one op, as they see torch's own higher-order ops, and the user's
policy decides whether it is saved or recomputed (a policy that does not name
it recomputes it, as any op it does not name).
"""
from .. import _compat
from .hop import scan_op


def scan_as_one_op(mode, *args, **kwargs):
    return mode.__torch_dispatch__(scan_op, [], args, kwargs)


for _mode in _compat.selective_checkpoint_modes():
    scan_op.py_impl(_mode)(scan_as_one_op)
