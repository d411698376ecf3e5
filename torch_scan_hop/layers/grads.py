"""Where the gradients of stacked storage go.

``grads="per_layer"`` (the default): every layer parameter gets its own
``.grad``, as for the loop. On CPU/CUDA autograd does it (``storage._stack_node``);
on XLA a post-accumulate hook on the leaf stack hands out gathered rows
(``register_xla_hand_out``).

``grads="stacked"``: the stacks are the trained parameters. Each is an
``nn.Parameter`` registered on the container (``stacked__<name>``, so
``model.parameters()``, optimizers, ``zero_grad``, ``requires_grad_`` and
``clip_grad_norm_`` see it) and kept out of ``state_dict``. The backward writes ONE
gradient per name into the stack's ``.grad``; no layer gets a ``.grad``. That is
what XLA needs: a gradient output per layer costs its compiler ~1 ms each (a
depth-64 decoder has 768), one per name costs nothing that grows with depth.
A layer run directly (outside ``scan_layers``) still trains: its gradient is moved
into its row of the stack's ``.grad`` (``route_layer_grads``).
"""
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _compat
from ..core.trees import ScanError
from .ownership import container_of
from .stack_weights import rows_of

MODES = ("per_layer", "stacked")
_PREFIX = "stacked__"


def stack_key(name):
    """The container's parameter name for the stack of ``name`` ("attn.qkv.weight" ->
    "stacked__attn__qkv__weight")."""
    return _PREFIX + name.replace(".", "__")


def check_mode(grads):
    if grads not in MODES:
        raise ScanError(f"stack_layers: grads must be one of {MODES}, got {grads!r}.")


def stack_keys(container):
    """``{name: key}`` of the stacks registered as parameters (empty in per_layer mode)."""
    return container.__dict__.get("_scan_stack_keys", {})


def register_stacks(container, stacked, owners):
    """Make every stack an ``nn.Parameter`` of ``container`` (reusing the one already
    registered for a name when it fits, so an optimizer holding it keeps training it),
    ``requires_grad`` when any layer's parameter does. Returns ``{name: Parameter}``."""
    keys = {name: stack_key(name) for name in stacked}
    if len(set(keys.values())) != len(keys):
        raise ScanError("stack_layers(grads='stacked'): two parameter names map to one stack name "
                        f"({sorted(keys)}); use grads='per_layer'.")
    drop_stacks(container, keep=set(keys.values()))
    out = {}
    for name, data in stacked.items():
        key, old = keys[name], container._parameters.get(keys[name])
        wants = any(m._parameters[leaf].requires_grad for m, leaf in owners[name])
        if isinstance(old, torch.nn.Parameter) and (old.shape, old.dtype, old.device) == (data.shape, data.dtype, data.device):
            with torch.no_grad():
                old.copy_(data)
            P = old
        else:
            P = torch.nn.Parameter(data, requires_grad=False)
            container.register_parameter(key, P)
        P.requires_grad_(wants and (P.is_floating_point() or P.is_complex()))
        out[name] = P
    container.__dict__["_scan_stack_keys"] = keys
    return out


def drop_stacks(container, keep=()):
    for key in [k for k in container._parameters if k.startswith(_PREFIX) and k not in keep]:
        del container._parameters[key]
    container.__dict__["_scan_stack_keys"] = {}


def registered_stacks(container):
    """``{name: the container's parameter under the stack's key}`` as it is now: after
    ``_apply`` / unpickling replaced or moved them, or with one swapped by
    ``torch.func.functional_call`` (what ``scan_layers`` then scans)."""
    return {name: container._parameters[key] for name, key in stack_keys(container).items()}


def stacks_swapped(container, fed):
    """Stacked mode: some stack ``fed`` to the scan is not the registered one (swapped by
    ``torch.func.functional_call``), so the layers' own Parameters are not what to run."""
    if fed is None or not stack_keys(container):
        return False
    return any(fed[name] is not P for name, P in container.__dict__["_scan_stacked"].items())


def drop_from_state_dict(container, destination, prefix):
    for key in stack_keys(container).values():
        destination.pop(prefix + key, None)


def forgive_missing(container, prefix, missing_keys):
    """State dicts have the layers' keys, never the stacks' (their rows ARE the layers)."""
    ours = {prefix + key for key in stack_keys(container).values()}
    missing_keys[:] = [k for k in missing_keys if k not in ours]


# --- stacked mode: flags and gradients of the layers -------------------------------------

def flags_message(container):
    """None when every layer parameter's ``requires_grad`` is its stack's, else a message
    naming the first layer that differs (a stack trains all its rows or none)."""
    stacks = registered_stacks(container)
    for name, where in container.__dict__.get("_scan_owners", {}).items():
        P = stacks.get(name)
        if P is None or not (P.is_floating_point() or P.is_complex()):
            continue
        for i, (m, leaf) in enumerate(where):
            p = m._parameters.get(leaf)
            if p is not None and p.requires_grad != P.requires_grad:
                return (f"scan_layers: with stack_layers(grads='stacked') the stack of '{name}' is trained "
                        f"as one parameter (requires_grad={P.requires_grad}), but layer {i}'s '{name}' has "
                        f"requires_grad={p.requires_grad}. Freeze or unfreeze a name in all layers at once "
                        f"(layers.requires_grad_(...) or layers.{stack_key(name)}.requires_grad_(...)), or "
                        "use stack_layers(layers, grads='per_layer') to freeze single layers.")
    return None


def check_flags_traced(container, token):
    """``flags_message`` under Dynamo: the answer asked in Python when the body is traced
    (unguarded: a layer frozen after compiling is refused in the backward, see
    ``_check_flags_after_backward``); the message traced only when it is no."""
    if not _flags_agree_when_traced(token):
        raise ScanError(flags_message(container))


@torch.compiler.assume_constant_result  # runs in Python when traced; the token is guarded
def _flags_agree_when_traced(token):
    return flags_message(container_of(token)) is None


_STACKS = WeakIdKeyDictionary()  # registered stack -> (container ref, name)


def _check_flags_after_backward(P):
    """A layer frozen after compiling is not seen by the compiled code (flags of the
    layers are not guarded); its row got a gradient. Refuse it before any optimizer
    step uses it: one flag read per layer and name, in Python, per backward."""
    found = _STACKS.get(P)
    container = None if found is None else found[0]()
    if container is None or container.grads_mode != "stacked":
        return
    for m, leaf in container.__dict__["_scan_owners"].get(found[1], ()):  # this stack's name only
        p = m._parameters.get(leaf)
        if p is not None and not p.requires_grad:
            P.grad = None
            raise ScanError(flags_message(container))


_ROUTES = WeakIdKeyDictionary()  # layer Parameter -> (container ref, name, row)


def route_layer_grads(container):
    """Stacked mode: a layer run directly (outside scan_layers) accumulates a gradient on
    its own Parameter; move it into its row of the stack's ``.grad``, so the optimizer,
    which trains the stack, sees it and nothing is updated twice. One hook per Parameter
    object, registered once; the route is updated on every restack."""
    ref = weakref.ref(container)
    _watch_optimizers()
    for name, P in container.__dict__["_scan_stacked"].items():
        _watch_stack(P, (ref, name))
    for name, where in container.__dict__.get("_scan_owners", {}).items():
        for i, (m, leaf) in enumerate(where):
            p = m._parameters[leaf]
            if p not in _ROUTES:
                p.register_post_accumulate_grad_hook(_move_grad_to_stack)
            _ROUTES[p] = (ref, name, i)


def _watch_stack(P, route):
    """The flags check after each backward, registered once per stack object (a copied or
    unpickled container has new ones), kept when the stack is frozen and unfrozen later."""
    if P not in _STACKS and (P.is_floating_point() or P.is_complex()):
        wanted = P.requires_grad
        P.requires_grad_(True)
        P.register_post_accumulate_grad_hook(_check_flags_after_backward)
        P.requires_grad_(wanted)
    _STACKS[P] = route


def unroute_layer_grads(container):
    for where in container.__dict__.get("_scan_owners", {}).values():
        for m, leaf in where:
            _ROUTES.pop(m._parameters.get(leaf), None)


_OPTIMIZERS_CHECKED = weakref.WeakKeyDictionary()  # optimizer -> (restacks seen, parameter count)
_RESTACKS = [0]


def _watch_optimizers():
    """An optimizer built on the layers' parameters before ``stack_layers(grads="stacked")``
    (or on some of them, without the stacks) would never see a gradient: the layers train
    silently not at all; one holding a stack in another param group than its layers' parameters
    would train it with options not meant for it. A global step pre-hook refuses both at the
    first step (rechecked after a restack or when its parameters change; skipped in a compiled
    step)."""
    _RESTACKS[0] += 1
    if _RESTACKS[0] == 1:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, args, kwargs):
    if torch.compiler.is_compiling():
        return
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    seen = (_RESTACKS[0], len(groups))
    if _OPTIMIZERS_CHECKED.get(optimizer) == seen:
        return
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        route = _ROUTES.get(p)
        container = None if route is None else route[0]()
        if container is None or container.__dict__.get("_scan_stack_broken", True):
            continue
        P = registered_stacks(container).get(route[1])
        if P is None or not P.requires_grad:
            continue
        where = (f"{type(optimizer).__name__} holds layer {route[2]}'s '{route[1]}' of a "
                 "stack_layers(..., grads='stacked') container")
        if id(P) not in groups:
            raise ScanError(
                f"{where} but not the stack trained in its place ('{stack_key(route[1])}'): the layers' own "
                "parameters get no gradient there. Build the optimizer after stack_layers from "
                "model.parameters() (or pass the stacks), or use grads='per_layer'.")
        _check_same_options(where, route, groups[id(p)], groups[id(P)])
    _OPTIMIZERS_CHECKED[optimizer] = seen


def _check_same_options(where, route, layer_group, stack_group):
    """A layer parameter's group states the options meant for it (e.g. no weight decay for biases
    and norms, a per-layer learning rate), but its stack is what trains: a stack in a group with
    other options would silently train otherwise (grouping by ``p.dim()`` does that: a stack has
    one more dimension than its rows)."""
    if layer_group is stack_group:
        return
    for key in sorted(set(layer_group) | set(stack_group)):
        if key in ("params", "param_names"):
            continue
        a, b = layer_group.get(key), stack_group.get(key)
        if not _same_option(a, b):
            raise ScanError(
                f"{where} in a param group with {key}={a!r}, but its stack '{stack_key(route[1])}' (what "
                f"trains in its place) is in a group with {key}={b!r}. Put the stack in the layers' group "
                "(a stack has one more dimension than a layer parameter: grouping by p.dim() separates "
                "them), leave the layer parameters out of the optimizer, or use grads='per_layer' for "
                "per-layer options.")


def _same_option(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a.detach().cpu(), b.detach().cpu())))
    try:
        return bool(a == b)
    except Exception:  # options without a truthy comparison (arrays): identity only
        return a is b


def _move_grad_to_stack(p):
    route = _ROUTES.get(p)
    container = None if route is None else route[0]()
    if container is None or container.__dict__.get("_scan_stack_broken", True):
        return
    P = registered_stacks(container).get(route[1])
    if P is None or not P.requires_grad or p.grad is None:
        return
    g, p.grad = p.grad, None
    with torch.no_grad():
        if P.grad is None:
            P.grad = torch.zeros_like(P)
        P.grad[route[2]] += g


# --- per_layer mode on XLA ------------------------------------------------------------------

def register_xla_hand_out(container, name, P):
    """The leaf stack's gradient handed to the layers as gathered rows (XLA compiles slice
    outputs slowly)."""
    ref = weakref.ref(container)

    def deliver(P):
        owner = ref()
        g = P.grad
        P.grad = None
        if owner is None or g is None:
            return
        with torch.no_grad():
            _hand_out(owner._scan_owners[name], rows_of(g))

    P.register_post_accumulate_grad_hook(deliver)


def _hand_out(owners, rows):
    """Give each layer parameter its gradient row, as its own accumulation would
    (on CPU/CUDA ``_stack_node``'s StackBackward0 and AccumulateGrad do this in C++)."""
    for (m, leaf), row in zip(owners, rows):
        p = m._parameters.get(leaf)
        if p is None or not p.requires_grad:
            continue
        if p._backward_hooks or p._post_accumulate_grad_hooks:
            _hand_out_with_hooks(p, row)
        elif p.grad is None:
            p.grad = row
        else:
            p.grad.add_(row)


def _hand_out_with_hooks(p, row):
    """What a leaf's accumulation runs around a gradient: ``register_hook`` hooks (each may
    replace it), accumulation, then ``register_post_accumulate_grad_hook`` hooks."""
    pre, post = _compat.leaf_grad_hooks(p)
    for hook in tuple(pre.values()):
        new = hook(row)
        row = row if new is None else new
    if p.grad is None:
        p.grad = row
    else:
        p.grad.add_(row)
    for hook in tuple(post.values()):
        hook(p)
