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

FSDP2 + tensor parallel (a ``parallelize_module``-d layer, then ``fully_shard``): FSDP2 lays
such a parameter out on (its mesh, the TP mesh). The scan takes its part along FSDP2's mesh
(``tensor_parallel_parts``, before stacking), the step gathers that part and wraps it into
the tensor-parallel DTensor FSDP2 would hand the module (``gathered_state``), and the view
runs the TP hooks around it (``layers.view``).

FSDP2's policies other than its defaults (mixed precision, offload, a divide factor) are
refused with a ScanError naming them.
"""
from .. import _compat
from ..core import dtensors as dt
from ..core.dtensors import Replicate, Shard
from ..core.trees import ScanError


def fsdp_modules(layer):
    """The FSDP2 modules in ``layer``'s tree (itself included)."""
    found = [layer] if _compat.distributed.is_fsdp_module(layer) else []
    for sub in _compat.nn.child_modules(layer).values():
        if sub is not None:
            found += fsdp_modules(sub)
    return found


def check_fsdp(layer):
    """None when ``layer`` (layer 0: the others have its structure) is not sharded by FSDP2;
    else ``(FSDP2's layout, tensor-parallel layout or None)``: ``(FSDP2's mesh, the placements
    it gives a plain parameter)`` and ``(TP mesh, this rank's coordinate there, its sizes)``.
    A ScanError when it is sharded with a policy or meshes a traced scan_layers does not
    reproduce."""
    modules = fsdp_modules(layer)
    if len(modules) == 0:  # not the truth of a list of modules: Dynamo cannot take it
        return None
    fsdp_meshes, tp_meshes = [], []
    for m in modules:
        why = _compat.distributed.fsdp_unsupported(m)
        if why is not None:
            raise ScanError(f"scan_layers: the layers are sharded by fully_shard with {why}; a traced "
                            "scan_layers gathers each layer's parameters in its step as FSDP2 does with its "
                            "default policies only. Use those, or loop over the layers.")
        for fsdp_mesh, tp_mesh in _compat.distributed.fsdp_meshes(m):
            _add_distinct(fsdp_meshes, fsdp_mesh)
            if tp_mesh is not None:
                _add_distinct(tp_meshes, tp_mesh)
    if len(fsdp_meshes) > 1 or len(tp_meshes) > 1:
        raise ScanError(f"scan_layers: the layers' parameters are sharded by fully_shard over several meshes "
                        f"({fsdp_meshes + tp_meshes}); a traced scan_layers gathers a layer along one FSDP "
                        "mesh (and one tensor-parallel mesh). Shard every layer alike, or loop over the layers.")
    mesh = fsdp_meshes[0]
    fsdp_layout = (mesh, (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0)))  # FSDP / HSDP
    if len(tp_meshes) == 0:
        return fsdp_layout, None
    tp = tp_meshes[0]
    return fsdp_layout, (tp, tuple(tp.get_coordinate()), tuple(tp.size(i) for i in range(tp.ndim)))


def _add_distinct(meshes, mesh):
    for seen in meshes:
        if seen == mesh:
            return
    meshes.append(mesh)


def tensor_parallel_parts(states, meshes):
    """``states`` (one dict per layer) with each FSDP2 + TP parameter replaced by its part along
    FSDP2's mesh (``dtensors.fsdp_part``), and ``{name: (TP placements, global shape)}`` of
    those, which the step needs to rebuild the tensor-parallel DTensors once gathered."""
    fsdp_layout, tp_layout = meshes
    k = fsdp_layout[0].ndim
    specs = {}
    for name, t in states[0].items():
        if tp_layout is not None and dt.is_dtensor(t) and len(t.placements) > k:
            specs[name] = (tuple(t.placements)[k:], tuple(t.shape))
    if len(specs) == 0:
        return states, specs
    parts = []
    for state in states:
        parts.append({name: dt.fsdp_part(t, fsdp_layout, tp_layout) if name in specs else t
                      for name, t in state.items()})
    return parts, specs


def gathered_state(params, meshes, tp_specs):
    """One step's layer state with its FSDP2-sharded parameters gathered along FSDP2's mesh,
    all with one all-gather (their gradients averaged with one reduce-scatter), as FSDP2 does
    per layer: in full, or, for FSDP2 + TP (``tp_specs``), as the tensor-parallel DTensors the
    layer's modules (and the view's TP hooks) expect."""
    names = [name for name, t in params.items() if dt.is_dtensor(t)]
    if not names:
        return params
    state = dict(params)
    for name, whole in zip(names, dt.gathered_together([params[name] for name in names])):
        if name in tp_specs:
            placements, shape = tp_specs[name]
            whole = dt.tensor_parallel_whole(whole, meshes[1][0], placements, shape)
        state[name] = whole
    return state
