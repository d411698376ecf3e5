"""Autograd internals: functorch's partitioners, the joint trace's node meta,
compiled autograd, selective checkpointing's modes and storage marker, custom-op formulas.
SAC's replaying storage is ``remat.sac_replay``."""
import contextlib

import torch
from torch._functorch.utils import unwrap_dead_wrappers


def drop_checkpoint_tags(graph_module):
    """Forget the activation-checkpoint tags a joint traced inside a compiled
    ``torch.utils.checkpoint`` region inherits from it (FX copies the running
    node's meta into every node it records): the partitioners would take the
    whole body for a checkpoint region, default_partition would switch to a
    min cut, and that cut fails on a joint with tags on one side only. The body's
    own ``remat`` decides what its step saves; the region recomputes the scan as
    one node. torch 2.9 to 2.15: node meta keys "recompute" and "ac_graph_id"."""
    for node in graph_module.graph.nodes:
        node.meta.pop("recompute", None)
        node.meta.pop("ac_graph_id", None)


def rename_node(node, name):
    """Give an FX node a new (unique) name. Partitioners tell primals from
    tangents by placeholder name, as AOTAutograd names them, so a joint traced
    here renames its placeholders. torch 2.9 to 2.15: ``Node._rename`` (no public API)."""
    node._rename(name)


def partitioner(name):
    """functorch's partition function for a remat policy name. Public
    (``functorch.compile``) on torch 2.9 to 2.15; 2.14 adds keyword-only options."""
    from functorch.compile import default_partition, min_cut_rematerialization_partition

    return {"save_all": default_partition, "min_cut": min_cut_rematerialization_partition}[name]


def extract_fwd_bwd(joint, saved_values, num_fwd_outputs):
    """functorch's fwd/bwd extraction for a hand-chosen list of saved nodes.

    torch 2.9 to 2.15: ``torch._functorch.partitioners._extract_fwd_bwd_modules``;
    2.14 adds a fourth positional parameter ``saved_opaque_nodes=None``, left
    at its default (the call passes the sym nodes positionally, the rest by keyword)."""
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    return _extract_fwd_bwd_modules(joint, saved_values, [], num_fwd_outputs=num_fwd_outputs)


@contextlib.contextmanager
def eager_autograd_engine():
    """Run torch.autograd.grad inside our joint trace on the plain engine, even
    while compiled autograd is on (it would try to Dynamo-compile our trace).
    torch 2.9 to 2.15: ``torch._dynamo.compiled_autograd._disable``."""
    import sys

    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is None:
        yield
        return
    with ca._disable():
        yield


def checkpoint_consumed_marker():
    """The value torch's SAC storage puts in place of a saved entry once the backward used it:
    ``torch.utils.checkpoint._CONSUMED`` (torch 2.14 on), None where there is none (2.9)."""
    from torch.utils import checkpoint as ckpt

    return getattr(ckpt, "_CONSUMED", None)


def selective_checkpoint_modes():
    """The dispatch modes of ``torch.utils.checkpoint``'s selective checkpointing
    (the forward's caching mode, the recompute's cached mode). torch 2.9 to 2.15:
    ``_CachingTorchDispatchMode`` and ``_CachedTorchDispatchMode``, private, same names."""
    from torch.utils import checkpoint as ckpt

    return ckpt._CachingTorchDispatchMode, ckpt._CachedTorchDispatchMode


def custom_op_lacks_autograd(qualified_name):
    """``qualified_name`` ("xla::einsum_linear_forward") is a torch.library
    custom op with no autograd formula registered, so one may be added with
    ``torch.library.register_autograd``. False for an op torch.library does
    not know. torch 2.9 to 2.15: ``torch._library.custom_ops._maybe_get_opdef``
    and the opdef's ``_backward_fn`` (None until a formula is registered)."""
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(qualified_name)
    return opdef is not None and opdef._backward_fn is None


def leaf_grad_hooks(t):
    """``(pre, post)``: the hooks a leaf's gradient accumulation runs, ``register_hook``
    ones (may replace the gradient) before, ``register_post_accumulate_grad_hook`` ones
    after; empty dicts when none. torch 2.9 to 2.15: ``Tensor._backward_hooks`` and
    ``Tensor._post_accumulate_grad_hooks`` (dicts or None)."""
    return t._backward_hooks or {}, t._post_accumulate_grad_hooks or {}


def apply_unbound(cls, *args):
    """``cls.apply(*args)`` for an ``autograd.Function`` with ``setup_context`` whose
    forward takes its arguments as given (no defaults to fill in): torch's ``apply``
    first binds them to the forward's ``inspect.signature``, anew on every call
    (~0.05 ms, a tenth of an eager XLA weight stack). Under functorch transforms, the
    full ``apply`` (its custom-function path). torch 2.9 to 2.15: ``Function.apply`` is that
    binding, ``unwrap_dead_wrappers``, then ``_FunctionBase.apply``."""
    if torch._C._are_functorch_transforms_active():
        return cls.apply(*args)
    return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))


def engine_backward(output):
    """The autograd engine's backward of the scalar ``output``, without ``torch.autograd.backward``'s
    Python wrapper around it. torch 2.12's wrapper (``_engine_run_backward``) leaves its stashed
    context (then None) in a C++ thread_local of the calling thread, which is freed after the
    thread's Python state and takes the GIL: a thread ending as the interpreter finalizes then
    aborts (2.9 stashes nothing; 2.15 erases it). torch 2.9 to 2.15: ``Variable._execution_engine
    .run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable=,
    accumulate_grad=)``."""
    from torch.autograd.variable import Variable

    Variable._execution_engine.run_backward((output,), (torch.ones_like(output),), False, False, (),
                                            allow_unreachable=True, accumulate_grad=True)
