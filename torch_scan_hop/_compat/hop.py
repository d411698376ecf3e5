"""HigherOrderOperator plumbing: ``torch._ops`` and ``torch._higher_order_ops``.

Names re-exported as they are: ``HigherOrderOperator`` (``torch._ops``; 2.14
adds the keyword ``supports_training_input_mutation=False``), and from
``torch._higher_order_ops.utils`` ``_from_fun``, ``_maybe_run_with_interpreter``,
``materialize_as_graph`` and ``reenter_make_fx`` (2.14 adds an optional
``subgraph_decomp_table`` to both, unused here), ``unique_graph_id`` and
``check_input_alias_and_mutation_return_outputs`` (signature differs: see
``input_mutations_and_outputs``).
"""
import torch
from torch._higher_order_ops.utils import (  # noqa: F401
    _from_fun,
    _maybe_run_with_interpreter,
    check_input_alias_and_mutation_return_outputs,
    materialize_as_graph,
    reenter_make_fx,
    unique_graph_id,
)
from torch._ops import HigherOrderOperator  # noqa: F401
from torch._ops import key_extractor as _key_extractor


def utils_module():
    """The module ``torch._higher_order_ops.utils`` itself (torch 2.9 to 2.15), for a patch of a
    function that inductor looks up there when it runs (``check_input_alias_and_mutation``)."""
    import torch._higher_order_ops.utils as hop_utils

    return hop_utils


def input_mutations_and_outputs(gm):
    """(indices of the inputs ``gm`` mutates, its example outputs).

    torch 2.9 takes the placeholders' example values as an argument; newer
    torch (2.1x, 2.14 included) reads them from the graph itself. The
    one-parameter branch serves 2.14, the two-parameter one 2.9.
    """
    import inspect

    params = inspect.signature(check_input_alias_and_mutation_return_outputs).parameters
    if len(params) == 1:
        *_, mutated, outputs = check_input_alias_and_mutation_return_outputs(gm)
    else:
        vals = [n.meta.get("val", n.meta.get("example_value")) for n in gm.graph.find_nodes(op="placeholder")]
        *_, mutated, outputs = check_input_alias_and_mutation_return_outputs(gm, vals)
    return mutated, outputs


def dispatch_flat(op, flat, args, kwargs):
    """``HigherOrderOperator.__call__(op, *args, **kwargs)`` when the caller knows the
    call's leaves (``flat``: the op's arguments as plain leaves, its body first): the same
    ``__torch_function__`` test and dispatch key set, without torch's two pytree
    flattenings of the arguments, paid at each of the op's levels (autograd,
    functionalization, the backend: ~0.1 ms per eager XLA call).
    torch 2.9 to 2.15: ``HigherOrderOperator.__call__`` is exactly this over pytree leaves."""
    if torch.overrides.has_torch_function(flat):
        return torch.overrides.handle_torch_function(op, flat, *args, **kwargs)
    keys = _key_extractor([t for t in flat if isinstance(t, torch.Tensor)], op.non_fallthrough_keys)
    return op.dispatch(keys.highestPriorityTypeId(), *args, **kwargs)


def install_as_upstream_scan(op):
    """Make ``torch.ops.higher_order.scan`` resolve to ``op``.

    The HOP registry and the ``torch.ops.higher_order`` namespace cache the
    first object under a name, so both must be overwritten.
    torch 2.9 to 2.15: the registry is ``torch._ops._higher_order_ops`` on all.
    """
    torch._ops._higher_order_ops["scan"] = op
    setattr(torch.ops.higher_order, "scan", op)


def is_hop(target):
    """An FX node target that is a HigherOrderOperator (torch 2.9 to 2.15: ``torch._ops``)."""
    return isinstance(target, HigherOrderOperator)


def schema_generator(op):
    """torch's builder of a HigherOrderOperator call's FunctionSchema for ``op`` (torch 2.9 to
    2.15: ``torch._higher_order_ops.schema.HopSchemaGenerator``; ``add_arg(name, value,
    kw_only=)``, ``add_output``, ``add_schema_tree_spec``, ``gen_schema``)."""
    from torch._higher_order_ops.schema import HopSchemaGenerator

    return HopSchemaGenerator(op)


def effectful(op):
    """``op`` is registered as an ordered effect: torch 2.14 registers some
    (``torch._higher_order_ops.effects._get_effect``); 2.9 has no such registry."""
    try:
        from torch._higher_order_ops.effects import _get_effect
    except ImportError:
        return False
    try:
        return _get_effect(op) is not None
    except Exception:  # noqa: BLE001  (an op the registry does not know)
        return False
