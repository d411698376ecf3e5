"""Remat policies as partition functions of a step's joint graph (see ``remat/policies.py``).

``partition_fn`` maps what ``scan``'s ``remat`` may be to a function
``(joint, inputs, *, num_fwd_outputs) -> (fwd, bwd)``: functorch's partitioners
for "save_all" / "min_cut", saving only the step's inputs for "recompute_all"
(and binomial, whose carry scheme exists in eager only, and "sqrt" where it reaches a graph: a
symbolic length; a static one is two scans before it gets here, ``api._sqrt_scan``), and ``policy_partition``
for a ``RematPolicy``; ``drop_names`` removes ``checkpoint_name``'s op after.
"""
import operator

import torch

from .. import _compat
from . import policies
from ..core.trees import ScanError


def _is_random(node):
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _items(node):
    """A node as saveable values: a multi-output op (SDPA's CPU kernel, say) through its getitems."""
    if isinstance(node.meta.get("val"), (tuple, list)):
        return [u for u in node.users if u.target is operator.getitem]
    return [node]


def _recompute_all_partition(joint, _inputs, *, num_fwd_outputs):
    """Save only the step's inputs (and random values, which must not be redrawn)."""
    saved = [n for n in joint.graph.find_nodes(op="placeholder") if "tangents" not in n.target]
    for n in joint.graph.nodes:
        if _is_random(n):
            saved.extend(_items(n))
    return _compat.extract_fwd_bwd(joint, saved, num_fwd_outputs)


def _has_collectives(joint):
    return any(getattr(n.target, "namespace", None) == "_c10d_functional" for n in joint.graph.nodes)


def _min_cut_partition(joint, inputs, *, num_fwd_outputs):
    """functorch's min-cut partition, except for a joint with collectives (a DTensor body,
    traced on each rank's local shards), which is partitioned as "save_all" is.

    Why: min-cut weighs values by their local sizes, which uneven shards make differ
    between ranks, so ranks can cut the same body differently; and a saved all-gather of a
    closure or an x slice is gathered again in the backward instead (``partition.
    _hoist_recomputable_saves``), so one rank's backward ran an all-gather the other's did
    not: a collective mismatch that aborted the process (gloo) or hung it. The save_all
    partition depends on the graph alone, which every rank traces alike."""
    name = "save_all" if _has_collectives(joint) else "min_cut"
    return _compat.partitioner(name)(joint, inputs, num_fwd_outputs=num_fwd_outputs)


def _policy_saves(policy, node):
    """Does ``policy`` keep this joint node's value (``checkpoint_name``'s node by its name)."""
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        src = node.args[0]
        return isinstance(src, torch.fx.Node) and _policy_saves(policy, src)
    if not _compat.is_op_overload(target) or target.is_view or _compat.op_schema(target).is_mutable:
        return False
    return policy.saves(target, node.args[1] if target is policies.NAMED_VALUE else None)


def policy_partition(policy):
    """A partition function for a ``RematPolicy``: walking back from what the
    backward reads, a value the policy saves (or a step input, or a random
    value) is saved and the walk stops there; everything between is recomputed
    in the backward, as in eager's replay of the step."""
    def partition(joint, _inputs, *, num_fwd_outputs):
        placeholders = joint.graph.find_nodes(op="placeholder")
        backward = {n for n in placeholders if "tangents" in n.target}
        for n in joint.graph.nodes:
            if n.op != "output" and any(a in backward for a in n.all_input_nodes):
                backward.add(n)
        stack = [a for n in backward for a in n.all_input_nodes if a not in backward]
        (outs,) = joint.graph.find_nodes(op="output")[0].args  # gradients that read no tangent (zeros_like)
        stack += [g for g in outs[num_fwd_outputs:] if isinstance(g, torch.fx.Node) and g not in backward]
        saved, seen = [], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            multi = isinstance(n.meta.get("val"), (tuple, list))
            if n.op == "placeholder" or (not multi and _policy_saves(policy, n)) or _is_random(n):
                saved.extend(v for v in _items(n) if v not in saved)
            else:
                stack.extend(n.all_input_nodes)
        return _compat.extract_fwd_bwd(joint, saved, num_fwd_outputs)
    return partition


def partition_fn(remat):
    """The partition function ``remat`` stands for (a name, a policy or its token, or a function)."""
    remat = policies.resolve(remat)
    if callable(remat):
        return remat
    if isinstance(remat, policies.RematPolicy):
        if remat.offload is not None:
            raise ScanError(f"scan: remat={remat.label} offloads its saved values to {remat.offload!r}, which is "
                            "implemented for eager scans only; traced (make_fx, torch.compile, export, XLA) "
                            "saved values stay on the device: drop offload there.")
        return policy_partition(remat)
    if remat in ("recompute_all", "sqrt") or policies.binomial_slots(remat) is not None:
        return _recompute_all_partition
    if remat == "min_cut":
        return _min_cut_partition
    if remat == "save_all":
        return _compat.partitioner(remat)
    policies.check_remat(remat)  # the one validator's message (the entries asked it already)
    raise AssertionError(f"remat={remat!r} is a policy without a partition here")


def drop_names(gm):
    """``checkpoint_name``'s op is the identity: gone from partitioned and body graphs."""
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=policies.NAMED_VALUE)):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm
