"""Bodies traced without the host-side checks torch 2.14 made effects (``without_effectful_checks``).

Traced under AOTAutograd, an effectful op takes an effect token that a scan body cannot thread
through its loop; every body trace (``trace.graph``, ``op.proxy``) drops those checks.
"""
import torch

from .. import _compat


class _DropEffectfulChecks(_compat.TorchDispatchMode):
    """Runs every op but the host-side checks torch 2.14 made effectful.

    A scan nested in the body reaches this mode as a higher-order operator:
    it runs as is (its own body is traced under a mode of its own)."""

    supports_higher_order_operators = True

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            return None
        return func(*args, **(kwargs or {}))


def without_effectful_checks(fn):
    """``fn`` traced without ``aten._linalg_check_errors`` when it is an effect
    (torch 2.14): traced under AOTAutograd, an effectful op takes an effect
    token that a scan body cannot thread through its loop, so a body using
    ``linalg.inv``/``solve`` failed to compile. The check raises on a singular
    matrix on the host; a compiled loop body has no host step to raise in (XLA
    drops it the same way). torch 2.9: ``fn`` unchanged."""
    check = getattr(torch.ops.aten, "_linalg_check_errors", None)
    ops = {check.default} if check is not None and _compat.hop.effectful(check.default) else set()
    if not ops:
        return fn

    def traced(*args):
        with _DropEffectfulChecks(ops):
            return fn(*args)

    return traced
