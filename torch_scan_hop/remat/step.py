"""A step with its remat policy applied: what the eager loop (``op/loop.py``) runs per step.

A scan's loop gets ONE replay engine for all its steps (``replay.StepReplay``); a call per layer
(``scan_layers``' eager loop) gets a ``torch.utils.checkpoint`` per call, selective where the policy
keeps some ops. Under torch.func transforms, which refuse saved-tensor hooks, the tape saves all.
"""
import functools

from torch.utils import checkpoint as _ckpt

from .. import _compat
from ..core.drain import drain_at_exit
from .policies import as_policy, binomial_slots, nothing_saveable
from .replay import StepReplay
from .sac_replay import replayable_selective_checkpoint_contexts


def _sac_policy(policy):
    def decide(ctx, op, *args, **kwargs):
        saves = policy.saves(op, None)
        return _ckpt.CheckpointPolicy.MUST_SAVE if saves else _ckpt.CheckpointPolicy.PREFER_RECOMPUTE
    return decide


def remat_step(step, remat, length=None):
    """``step`` with the remat policy applied (see ``op/loop.py``'s docstring).

    With ``length`` (a scan's loop) one ``StepReplay`` serves all steps; without
    (one call per layer, ``scan_layers``) each call is a torch.utils.checkpoint.
    Under torch.func transforms (which refuse saved-tensor hooks) the tape saves all."""
    policy = as_policy(remat)
    if policy is None or _compat.functorch_transforms_active():
        return step
    drain_at_exit()  # the steps' nodes carry saved-tensor hooks: see core/drain.py
    if length is not None:
        return StepReplay(step, policy, length, sqrt=remat == "sqrt", min_cut=remat == "min_cut",
                          slots=binomial_slots(remat))
    if policy.save is nothing_saveable.save:
        return functools.partial(_ckpt.checkpoint, step, use_reentrant=False)
    contexts = functools.partial(replayable_selective_checkpoint_contexts, _sac_policy(policy))
    return functools.partial(_ckpt.checkpoint, step, use_reentrant=False, context_fn=contexts)
