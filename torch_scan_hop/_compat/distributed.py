"""torch.distributed internals scan_layers reads about FSDP2 (``fully_shard``) layers.

Public: ``torch.distributed.fsdp.FSDPModule``. Private (torch 2.9): FSDP2's hooks
live in ``torch.distributed.fsdp._fully_shard`` (their functions' ``__module__``),
and an FSDP module's parameter group (``FSDPModule._get_fsdp_state()._fsdp_param_group``)
holds its ``mp_policy``, ``offload_policy``, ``gradient_divide_factor`` and ``mesh_info``;
each of its ``fsdp_params`` the ``sharded_param`` and, for FSDP + TP, the tensor-parallel
spec it was sharded from.
"""

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch built without distributed
    FSDPModule = None

_FSDP_PACKAGE = "torch.distributed.fsdp._fully_shard"


def is_fsdp_module(module):
    return FSDPModule is not None and isinstance(module, FSDPModule)


def is_fsdp_hook(hook):
    """``hook`` is one of FSDP2's own (its function lives in FSDP2's package)."""
    fn = getattr(hook, "__func__", hook)
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return (getattr(fn, "__module__", None) or "").startswith(_FSDP_PACKAGE)


# where torch defines the hooks that tensor parallelism puts on a module: distribute_module's
# input_fn / output_fn wrappers (ColwiseParallel, RowwiseParallel, SequenceParallel) and
# PrepareModuleInput / PrepareModuleOutput's own
_TP_HOOK_MODULES = ("torch.distributed.tensor._api", "torch.distributed.tensor.parallel.style")


def is_tensor_parallel_hook(hook):
    """``hook`` is one of tensor parallelism's layout hooks (``parallelize_module``): it turns a
    module's inputs and outputs into DTensors of the style's layouts and back, holding no state.
    torch 2.9 to 2.15: lambdas defined in ``_TP_HOOK_MODULES``."""
    return getattr(hook, "__name__", None) == "<lambda>" and getattr(hook, "__module__", None) in _TP_HOOK_MODULES


def _param_groups(state):
    """torch up to 2.14: ``state._fsdp_param_group`` (one group or None); newer torch keeps a
    list, ``state._fsdp_param_groups``."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def _mp_policies(group):
    """The group's MixedPrecisionPolicy (torch 2.9), or its parameters' (newer torch)."""
    mp = getattr(group, "mp_policy", None)
    if mp is not None:
        return [mp]
    return [p.mp_policy for p in group.fsdp_params if getattr(p, "mp_policy", None) is not None]


def fsdp_unsupported(module):
    """Why a traced scan_layers cannot stand in for FSDP2's hooks on ``module``
    (a message), or None: it gathers each parameter along FSDP2's mesh and averages its
    gradient there, which is FSDP2 with its default policies on its own mesh (1-D FSDP
    or 2-D HSDP), tensor-parallel parameters included (``fsdp_meshes``)."""
    try:
        for group in _param_groups(module._get_fsdp_state()):
            why = _group_unsupported(group)
            if why is not None:
                return why
    except AttributeError as e:  # FSDP2's internals moved in this torch: say so rather than guess
        return f"FSDP2 state this torch's version lays out differently than scan_layers reads it ({e})"
    return None


def fsdp_meshes(module):
    """``(FSDP2's mesh, the tensor-parallel mesh or None)`` of each of ``module``'s FSDP2
    parameters (``fsdp_unsupported`` has passed it)."""
    return [(group.mesh_info.mesh, _tensor_parallel_mesh(p)) for group in _param_groups(module._get_fsdp_state())
            for p in group.fsdp_params]


def _tensor_parallel_mesh(fsdp_param):
    """The mesh of a parameter's tensor-parallel DTensor before FSDP2 sharded it, or None for
    a plain one: FSDP2 + TP lays the sharded parameter out on (FSDP2's mesh dims, then the TP
    mesh's), FSDP2's placements first. torch 2.9-2.11: ``_tp_spec``; later torch:
    ``_unsharded_dtensor_spec``."""
    spec = getattr(fsdp_param, "_tp_spec", None) or getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    return None if spec is None else spec.mesh


def _group_unsupported(group):
    for mp in _mp_policies(group):
        if mp.param_dtype is not None or mp.reduce_dtype is not None or mp.output_dtype is not None:
            return f"a MixedPrecisionPolicy ({mp})"
    if type(group.offload_policy).__name__ != "OffloadPolicy":
        return f"an offload policy ({type(group.offload_policy).__name__})"
    if group.gradient_divide_factor is not None:
        return f"a gradient divide factor ({group.gradient_divide_factor})"
    if type(group.mesh_info).__name__ not in ("FSDPMeshInfo", "HSDPMeshInfo"):
        return f"a mesh layout other than FSDP's or HSDP's ({type(group.mesh_info).__name__})"
    mesh = group.mesh_info.mesh
    for fsdp_param in group.fsdp_params:
        param_mesh = fsdp_param.sharded_param.device_mesh
        if param_mesh == mesh:
            continue
        tp_mesh = _tensor_parallel_mesh(fsdp_param)
        if tp_mesh is None or param_mesh.ndim != mesh.ndim + tp_mesh.ndim:
            return (f"a parameter laid out on {param_mesh}, neither FSDP2's mesh {mesh} nor it followed "
                    "by one tensor-parallel mesh")
    return None
