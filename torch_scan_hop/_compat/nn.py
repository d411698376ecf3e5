"""``nn.Module`` internals that scan_layers reads to stack layers' state and
to refuse hooks a traced scan would not run.

torch 2.9 to 2.15: ``Module._parameters`` / ``_buffers`` / ``_modules`` and the
per-module and global hook dicts have the same names and types on all.
"""


def global_module_hooks_registered():
    """Hooks registered for every module (``register_module_forward_hook``
    and the like). torch 2.9 to 2.15: ``torch.nn.modules.module._global_*_hooks``."""
    from torch.nn.modules import module as m

    return any(getattr(m, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))


def module_has_hooks(module):
    """``module`` itself has forward, forward-pre, backward or backward-pre
    hooks. torch 2.9 to 2.15: the ``_forward_hooks``... dicts (no public query). ``len``, not
    ``bool``: Dynamo cannot take the truth of a non-empty hooks dict (a graph break)."""
    return (len(module._forward_hooks) + len(module._forward_pre_hooks) + len(module._backward_hooks)
            + len(module._backward_pre_hooks)) > 0


def module_hooks(module):
    """``(kind, hook)`` for every hook registered on ``module`` itself, kind being
    "forward", "forward_pre", "backward" or "backward_pre" (torch 2.9 to 2.15: the
    ``_forward_hooks``... dicts, no public query)."""
    return [(kind, h) for kind, hooks in (("forward", module._forward_hooks), ("forward_pre", module._forward_pre_hooks),
                                          ("backward", module._backward_hooks),
                                          ("backward_pre", module._backward_pre_hooks))
            for h in hooks.values()]


def forward_pre_hooks(module):
    """``[(hook, takes_kwargs)]`` of ``module``'s forward pre-hooks, in the order they run
    (torch 2.9 to 2.15: ``_forward_pre_hooks`` and the ids in ``_forward_pre_hooks_with_kwargs``)."""
    return [(h, i in module._forward_pre_hooks_with_kwargs) for i, h in module._forward_pre_hooks.items()]


def forward_hooks(module):
    """``[(hook, takes_kwargs)]`` of ``module``'s forward hooks, in the order they run."""
    return [(h, i in module._forward_hooks_with_kwargs) for i, h in module._forward_hooks.items()]


def own_parameters(module):
    """``{name: parameter or None}`` registered on ``module`` itself, in order,
    None entries included (``named_parameters`` skips them and recurses)."""
    return module._parameters


def own_buffers(module):
    """``{name: buffer or None}`` registered on ``module`` itself, in order."""
    return module._buffers


def child_modules(module):
    """``{name: submodule or None}``, the direct children in order (the dict
    itself: ``named_children`` skips None and duplicates)."""
    return module._modules


def state_tensor(module, path, is_param):
    """The parameter (or buffer) at ``path`` (a state_dict name split at its dots) of ``module``:
    the dict reads ``own_parameters``/``child_modules`` would make, in one function (under
    Dynamo one inlined call per tensor)."""
    for part in path[:-1]:
        module = module._modules[part]
    return (module._parameters if is_param else module._buffers)[path[-1]]


def tree_objects(module):
    """Every module of ``module``'s tree and the dicts holding its parameters, buffers and
    children: the objects a traced frame may have changed (an attribute set, a parameter swapped)."""
    return [o for m in module.modules() for o in (m, m._parameters, m._buffers, m._modules)]


def children_named(modules, name):
    """Each module's child ``name``: ``child_modules`` in one list comprehension
    (under Dynamo one inlined call, not one per module)."""
    return [m._modules[name] for m in modules]


def updates_running_stats(module):
    """``module`` is a norm layer whose forward updates its running-statistics
    buffers in place (BatchNorm*/InstanceNorm* in training mode with
    ``track_running_stats``). torch 2.9 to 2.15: their common base
    ``torch.nn.modules.batchnorm._NormBase``."""
    from torch.nn.modules.batchnorm import _NormBase

    return isinstance(module, _NormBase) and module.training and module.track_running_stats
