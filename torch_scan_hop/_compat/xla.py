"""torch_xla internals: the ``torch_xla._XLAC`` bindings the While lowering
needs, and a private op of its SPMD module.

Only torch_xla 2.9 exists for these (no torch_xla build for torch 2.14 in
our environments): every adapter here serves torch_xla 2.9 and imports
torch_xla only when called.
"""
import os
import sys


def xlac():
    """The ``torch_xla._XLAC`` extension module (torch_xla 2.9): its C++
    bindings have no Python API for staging out or running HLO."""
    import torch_xla

    return torch_xla._XLAC


def lowering_context(name):
    """An XLA LoweringContext that builds the HLO of lazy tensors
    (``build``, ``hlo``, ``tensor_parameter_id``,
    ``device_parameter_id_tensor_mapping``). torch_xla 2.9."""
    return xlac().lowering.LoweringContext(name)


def device_data_nodes(tensors):
    """(ids, tensors) of the device-data nodes the IR of ``tensors`` reads.
    torch_xla 2.9: ``_get_tensors_xla_device_data_node``."""
    return xlac()._get_tensors_xla_device_data_node(tensors)


def seed_info_id():
    """The device-data id of XLA's RNG seed. torch_xla 2.9: ``_get_seed_info_id``."""
    return xlac()._get_seed_info_id()


def computation_from_module_proto(name, module):
    """A computation object from a serialized HloModuleProto.
    torch_xla 2.9: ``_xla_op_computation_from_module_proto``."""
    return xlac()._xla_op_computation_from_module_proto(name, module)


def user_computation(name, inputs, computation):
    """Run ``computation`` as one op named ``name`` on XLA tensors ``inputs``;
    returns its outputs. torch_xla 2.9: ``_xla_user_computation``."""
    return xlac()._xla_user_computation(name, inputs, computation)


def on_next_sync(fn):
    """Call ``fn()`` at the next ``torch_xla.sync()`` / ``mark_step`` (after its launch). torch_xla
    2.9: ``torch_xla.core.xla_model.add_step_closure`` (public; here with the other torch_xla
    names so every version question about them is asked in one place)."""
    import torch_xla.core.xla_model as xm

    xm.add_step_closure(fn)


_BRIDGE_RUNS = ("extract_graph_helper", "extract_compiled_graph_helper")


def in_openxla_bridge():
    """Is torch_xla's Dynamo bridge (``backend="openxla"``) running a graph to extract its
    program? Its replays then run that program without our Python, and tensors it read stay its
    inputs. torch_xla 2.9 keeps no flag for it: its ``dynamo_bridge`` functions are looked for on
    the Python stack (``sys._getframe``, ~10 us)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _BRIDGE_RUNS and code.co_filename.endswith("dynamo_bridge.py"):
            return True
        frame = frame.f_back
    return False


def aot_mark_sharding(tensor, mesh, partition_spec):
    """torch_xla's ``xla::aot_mark_sharding`` op as ``MarkShardingFunction``
    calls it (``mesh`` and ``partition_spec`` as strings). torch_xla 2.9:
    ``torch_xla.distributed.spmd.xla_sharding._aot_mark_sharding``."""
    from torch_xla.distributed.spmd.xla_sharding import _aot_mark_sharding

    return _aot_mark_sharding(tensor, mesh, partition_spec)


def materialize(tensors):
    """Compute the pending lazy values of ``tensors`` into device data now,
    without waiting and without touching other tensors (unlike ``torch_xla.sync``).
    torch_xla 2.9: ``_xla_sync_multi`` (what ``xm.unlazy`` calls, with wait=True)."""
    xlac()._xla_sync_multi(list(tensors), devices=[], wait=False)


def spmd_active():
    """Is XLA SPMD on? Off it, no tensor carries a sharding. torch_xla 2.9-2.x keeps
    the switch in an environment variable (``runtime.use_spmd`` sets it; ``is_spmd``
    reads it): a dict lookup, where asking each tensor costs a C++ call per tensor."""
    flag = os.environ.get("XLA_USE_SPMD", "")
    return flag == "true" or (flag.isdigit() and int(flag) > 0)  # torch_xla's utils.check_env_flag


def op_sharding(tensor):
    """The OpSharding torch_xla 2.9 keeps on an XLA tensor, or None when it has
    none (not SPMD, or not annotated): ``_get_xla_sharding_spec`` and
    ``_get_xla_op_sharding``."""
    if not xlac()._get_xla_sharding_spec(tensor):
        return None
    return xlac()._get_xla_op_sharding(tensor)


def with_op_sharding(tensor, sharding):
    """A copy of ``tensor`` annotated with ``sharding`` (a Sharding custom call,
    as ``annotate_custom_sharding`` adds). torch_xla 2.9: ``_xla_annotate_custom_sharding``."""
    out = tensor.clone()
    xlac()._xla_annotate_custom_sharding(out, sharding)
    return out


def spmd_module():
    """torch_xla's ``distributed.spmd.xla_sharding`` module (``Mesh``) if it is loaded, else None
    (torch_xla 2.9; nothing is imported)."""
    import sys

    return sys.modules.get("torch_xla.distributed.spmd.xla_sharding")


# torch_xla's FSDPv2 wrapper, told by its class's module and name (torch_xla is not imported for it)
_FSDP_V2 = ("torch_xla.experimental.spmd_fully_sharded_data_parallel", "SpmdFullyShardedDataParallel")


def is_fsdp_v2(module):
    """``module`` is torch_xla's FSDPv2 wrapper (``SpmdFullyShardedDataParallel``)."""
    cls = type(module)
    return (cls.__module__, cls.__name__) == _FSDP_V2


def is_fsdp_v2_barrier_hook(hook):
    """FSDPv2's full backward hook (``apply_backward_optimization_barrier``): an optimization
    barrier over the module's gradients, a hint that keeps XLA from fusing one layer's
    backward with the next, with no effect on values. torch_xla 2.9: a function local to
    ``xla_sharding.apply_backward_optimization_barrier``."""
    return (getattr(hook, "__module__", None) == "torch_xla.distributed.spmd.xla_sharding"
            and getattr(hook, "__qualname__", "").startswith("apply_backward_optimization_barrier."))


def fsdp_v2_output_spec(module, output):
    """``(mesh, partition spec)`` FSDPv2's default ``shard_output`` gives ``output``, or None
    when the wrapper was given a ``shard_output`` of its own. torch_xla 2.9: the default is
    ``shard_output_impl``, a closure over ``extra_data_axis``, whose spec comes from
    ``_prepare_spmd_partition_spec(output, extra_data_axis)``."""
    fn = module._shard_output
    if getattr(fn, "__qualname__", "") != "SpmdFullyShardedDataParallel.__init__.<locals>.shard_output_impl":
        return None
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    extra = cells["extra_data_axis"].cell_contents if "extra_data_axis" in cells else None
    return module._mesh, _prepare_spmd_partition_spec(output, extra)


def mark_sharding_with_gradients(tensor, mesh, partition_spec):
    """torch_xla's functional sharding annotation (traceable into a scan body, its gradient
    annotated alike), where ``xs.mark_sharding`` annotates in place."""
    import torch_xla.distributed.spmd as xs

    return xs.mark_sharding_with_gradients(tensor, mesh, partition_spec)
