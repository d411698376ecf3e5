"""torch.distributed internals scan_layers reads about FSDP2 (``fully_shard``) layers.

Public: ``torch.distributed.fsdp.FSDPModule``. Private (torch 2.9): FSDP2's hooks
live in ``torch.distributed.fsdp._fully_shard`` (their functions' ``__module__``),
and an FSDP module's parameter group (``FSDPModule._get_fsdp_state()._fsdp_param_group``)
holds its ``mp_policy``, ``offload_policy``, ``gradient_divide_factor`` and ``mesh_info``.
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
    torch 2.9-2.15: lambdas defined in ``_TP_HOOK_MODULES``."""
    return getattr(hook, "__name__", None) == "<lambda>" and getattr(hook, "__module__", None) in _TP_HOOK_MODULES


def _param_groups(state):
    """torch 2.9-2.14: ``state._fsdp_param_group`` (one group or None); newer torch keeps a
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
    (a message), or None: it gathers each parameter in full and averages its
    gradient over the mesh, which is FSDP2 with its default policies on its own
    mesh (1-D FSDP or 2-D HSDP, no tensor parallel dims)."""
    try:
        for group in _param_groups(module._get_fsdp_state()):
            why = _group_unsupported(group)
            if why is not None:
                return why
    except AttributeError as e:  # FSDP2's internals moved in this torch: say so rather than guess
        return f"FSDP2 state this torch's version lays out differently than scan_layers reads it ({e})"
    return None


def _group_unsupported(group):
    for mp in _mp_policies(group):
        if mp.param_dtype is not None or mp.reduce_dtype is not None or mp.output_dtype is not None:
            return f"a MixedPrecisionPolicy ({mp})"
    if type(group.offload_policy).__name__ != "OffloadPolicy":
        return f"an offload policy ({type(group.offload_policy).__name__})"
    if group.gradient_divide_factor is not None:
        return f"a gradient divide factor ({group.gradient_divide_factor})"
    mesh = group.mesh_info.mesh
    for fsdp_param in group.fsdp_params:
        if fsdp_param.sharded_param.device_mesh != mesh:
            return "parameters that are also tensor-parallel DTensors (FSDP + TP)"
    return None
