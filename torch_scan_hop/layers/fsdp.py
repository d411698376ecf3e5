"""FSDP2 (``fully_shard``) layers in a traced ``scan_layers``.

In eager ``scan_layers`` is the loop over the layers, FSDP2's hooks and all. Traced,
the body runs layer 0's code and no module's hooks, so what FSDP2's hooks do for a
layer is done in the body instead, per step and for that step's layer only:

* the layers' sharded parameters (DTensors, ``Shard(0)``) are stacked locally into one
  DTensor per name (``Shard(1)``, no communication; ``stack_weights``);
* the step's slice is gathered in full inside the step (``dtensors.gathered_together``:
  one all-gather of all the layer's shards, in the forward body and again in the
  backward body: the partitioner
  recomputes a gathered slice rather than saving it, as FSDP2 reshards after forward);
* its gradient is averaged over the mesh and reduce-scattered back to the slice's
  layout inside the backward step, so each layer's ``.grad`` is sharded like its
  parameter, as FSDP2's reduce-scatter leaves it.

FSDP2's policies other than its defaults (mixed precision, offload, a divide factor,
FSDP + tensor parallel) are refused with a ScanError naming them.
"""
from .. import _compat
from ..core import dtensors as dt
from ..core.trees import ScanError


def fsdp_modules(layer):
    """The FSDP2 modules in ``layer``'s tree (itself included)."""
    found = [layer] if _compat.distributed.is_fsdp_module(layer) else []
    for sub in _compat.nn.child_modules(layer).values():
        if sub is not None:
            found += fsdp_modules(sub)
    return found


def check_fsdp(layer):
    """Whether ``layer`` (layer 0: the others have its structure) is sharded by FSDP2, or a
    ScanError when it is with a policy a traced scan_layers does not reproduce."""
    modules = fsdp_modules(layer)
    for m in modules:
        why = _compat.distributed.fsdp_unsupported(m)
        if why is not None:
            raise ScanError(f"scan_layers: the layers are sharded by fully_shard with {why}; a traced "
                            "scan_layers gathers each layer's parameters in its step as FSDP2 does with its "
                            "default policies only. Use those, or loop over the layers.")
    return len(modules) > 0  # not bool(): Dynamo cannot take the truth of a list of modules


def gathered_state(params):
    """One step's layer state with its FSDP2-sharded parameters gathered in full, all with
    one all-gather (their gradients with one reduce-scatter), as FSDP2 does per layer."""
    names = [name for name, t in params.items() if dt.is_dtensor(t)]
    if not names:
        return params
    state = dict(params)
    state.update(zip(names, dt.gathered_together([params[name] for name in names])))
    return state
