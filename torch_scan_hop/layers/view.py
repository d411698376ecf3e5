"""The body's view of layer 0: layer 0 seen with one step's slice of the stacked weights.

A traced ``scan_layers`` runs layer 0's code once per step on that step's weights through
this read-only view (``view_of``): nothing is written to the module, so the body has no
side effects and swaps no parameters. The view also stands in for the module's
``__call__`` where the layers' hooks must run in the body (tensor parallelism's layouts)
or be recorded (transformers' capture, ``layers.capture``), and for the forward of
torch_xla's FSDPv2 wrapper, whose output annotation is in place.
"""
import functools
import inspect
import types

import torch

from .. import _compat
from ..core.trees import ScanError
from .layer_state import MISSING, check_peers_agree


_WRITTEN = "written"  # the key of an attribute the body wrote: (_WRITTEN, path) in the view tree's dict
LABELS = ("labels",)  # the key of the names of the layer and its peers in messages (default: layer i)


class _LayerView:
    """Layer 0 seen with one layer's slice of the stacked weights.

    Attribute reads resolve to the slice (parameters, buffers), to views of
    submodules, to methods of the module's class bound to the view, or else to
    the module's own attributes. Nothing is written to the module, so the body
    has no side effects (which Dynamo refuses inside a scan body) and no
    parameter swapping per step. Of the module hooks, only tensor parallelism's
    layout hooks are run (``__call__``); the others were checked before the scan
    (``layers.checks``). (State is read via ``self.__dict__``, which Dynamo traces
    on objects created in the body.)

    A plain attribute the body reads (a scale, ``training``) is layer 0's for
    every step, so it is compared with the same attribute of every layer
    (``peers``) as it is read: a layer that differs is a ScanError naming it.
    Checking on read covers exactly what the code uses, and is the one form
    Dynamo can trace (it cannot enumerate a module's ``__dict__``). Attributes
    the body writes are kept per step (``__setattr__``), not on the module.
    """

    def __init__(self, module, state, prefix="", peers=(), checked=None, parent=None, recorder=None):
        # names no module attribute is likely to have: the view answers these itself
        self._view_m, self._view_state, self._view_prefix = module, state, prefix
        self._view_peers, self._view_parent = peers, parent
        self._view_checked = {} if checked is None else checked  # names compared with the peers, whole tree
        self._view_recorder = recorder  # capture.StepRecords while a transformers model collects, else None

    def __setattr__(self, name, value):
        """A plain attribute the body writes (RecurrentGemma's ``self.recurrent_states = None``)
        is kept for the rest of the step, for every view of the same module, and never
        written to the module: the body reads back what it wrote, as the loop would, and
        the scan has no side effects on the layers."""
        if name.startswith("_view_"):
            object.__setattr__(self, name, value)
            return
        d = self.__dict__
        d["_view_checked"][(_WRITTEN, d["_view_prefix"] + name)] = value

    def __getattr__(self, name):
        d = self.__dict__
        if "_view_m" not in d:  # Dynamo probing a not-yet-initialized stand-in
            raise AttributeError(name)
        module, state, prefix = d["_view_m"], d["_view_state"], d["_view_prefix"]
        written = (_WRITTEN, prefix + name)
        if written in d["_view_checked"]:
            return d["_view_checked"][written]
        if prefix + name in state:
            return state[prefix + name]
        children = _compat.nn.child_modules(module)
        if name in children:
            sub = children[name]  # its peers are found when it first reads a plain attribute
            return None if sub is None else view_of(
                sub, state, prefix + name + ".", None, d["_view_checked"], (d, name), d["_view_recorder"])
        if name == "_modules":  # torch's containers read their children from this attribute
            return {k: getattr(self, k) for k in children}
        attr = getattr(type(module), name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if isinstance(attr, types.FunctionType):  # a method: bound to the view; a staticmethod as it is
            return attr if _is_static(type(module), name) else _ViewMethod(attr, self)
        value = getattr(module, name)
        if prefix + name not in d["_view_checked"]:  # once per trace: a check reads the attribute of every layer
            check_peers_agree(prefix + name, value, [getattr(p, name, MISSING) for p in _peers_of(d)],
                              d["_view_checked"].get(LABELS))
            d["_view_checked"][prefix + name] = True
        return value

    def __call__(self, *args, **kwargs):
        module = self.__dict__["_view_m"]
        if _compat.xla.is_fsdp_v2(module):
            return _fsdp_v2_call(self, module, args, kwargs)
        layouts = _compat.nn.module_has_hooks(module)  # the tensor-parallel ones run here, as in __call__
        if layouts:
            args, kwargs = _run_layout_pre_hooks(module, self, args, kwargs)
        out = self.forward(*args, **kwargs)
        if layouts:
            out = _run_layout_hooks(module, self, args, kwargs, out)
        recorder = self.__dict__["_view_recorder"]
        if recorder is not None:  # what this module's collecting hooks would be given (layers.capture)
            recorder.record(self.__dict__["_view_prefix"], args, out)
        return out

    @property
    def forward(self):
        """The module class's forward bound to the view. A class attribute too: code that
        reads ``type(self).forward`` (transformers' checkpointing wrapper asks whether it
        is the outermost one) finds this property, not the module class's function, so
        such a wrapper takes itself for an inner one and runs the plain forward."""
        return self.__getattr__("forward")

    def __iter__(self):  # containers (Sequential, ModuleList) iterate their children
        return iter(self._modules.values())

    def __len__(self):
        module = self.__dict__.get("_view_m")
        return 0 if module is None else len(_compat.nn.child_modules(module))

    def __bool__(self):  # a module is truthy whatever its number of children
        return True

    def __getitem__(self, idx):
        return list(self._modules.values())[idx]


class _ViewMethod:
    """A method of the layer's class bound to a view: ``view.feed_forward_chunk``.

    Not ``types.MethodType``, which Dynamo before torch 2.15 cannot create in traced code,
    nor ``functools.partial``, whose ``inspect.signature`` Dynamo before 2.15 traces into
    inspect's own code and stops at (``hasattr(type(partial), "__get__")``): layer code
    does ask, BertLayer's ``apply_chunking_to_forward(self.feed_forward_chunk, ...)``
    counts the method's parameters. ``inspect.signature`` reads ``__signature__`` before
    anything else it could trip on, so this object answers with the bound method's
    signature, made in Python, not traced (``_bound_signature``).
    """

    def __init__(self, func, view):
        self.__func__, self.__self__ = func, view

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self):
        return _bound_signature(self.__func__)


_SIGNATURES = {}  # a layer class's function -> its signature as a bound method


@torch.compiler.assume_constant_result  # run in Python when traced: a class's methods do not change
def _is_static(cls, name):
    """Whether ``cls.name`` is a ``staticmethod`` (read as a plain function, it takes no ``self``)."""
    return isinstance(inspect.getattr_static(cls, name, None), staticmethod)


@torch.compiler.assume_constant_result  # run in Python when traced: Dynamo holds the Signature it returns
def _bound_signature(func):
    """``inspect.signature`` of ``func`` bound to an instance (its first parameter dropped, as
    Python drops it for a method), once per function: the layer's class does not change."""
    sig = _SIGNATURES.get(func)
    if sig is None:
        sig = _SIGNATURES[func] = inspect.signature(types.MethodType(func, object()))
    return sig


def _run_layout_pre_hooks(module, view, args, kwargs):
    """``module``'s tensor-parallel forward pre-hooks (``parallelize_module``'s input layouts),
    called on the view as ``nn.Module.__call__`` calls them: layer 0's hooks for every
    layer, as the layers' styles agree (their sharded weights are stacked together). The
    module's other hooks were checked already: done elsewhere in the body, or refused."""
    for hook, takes_kwargs in _compat.nn.forward_pre_hooks(module):
        if not _compat.distributed.is_tensor_parallel_hook(hook):
            continue
        if takes_kwargs:
            result = hook(view, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(view, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _run_layout_hooks(module, view, args, kwargs, out):
    """``module``'s tensor-parallel forward hooks (output layouts), as ``__call__`` runs them."""
    for hook, takes_kwargs in _compat.nn.forward_hooks(module):
        if _compat.distributed.is_tensor_parallel_hook(hook):
            result = hook(view, args, kwargs, out) if takes_kwargs else hook(view, args, out)
            out = out if result is None else result
    return out


def _fsdp_v2_call(view, module, args, kwargs):
    """torch_xla's FSDPv2 wrapper, as its forward runs: the wrapped layer, then its output
    annotated for FSDP (batch dim over "fsdp"), but with the functional annotation, which a
    scan body can hold (its default ``shard_output`` annotates in place). Its backward hook,
    an optimization barrier between layers' backwards, has no effect on values and is left
    out: the scan's backward runs one layer per step anyway."""
    out = view._orig_module(*args, **kwargs)
    first = _first_tensor(out)
    if first is None:
        raise ScanError("scan_layers: the layers are wrapped by torch_xla's SpmdFullyShardedDataParallel "
                        f"and return {type(out).__name__}, not a tensor or a tuple starting with one, which "
                        "FSDPv2 cannot shard either, or wrap the layers' container instead of each layer.")
    spec = _compat.xla.fsdp_v2_output_spec(module, first)
    if spec is None:
        raise ScanError("scan_layers: the layers are wrapped by torch_xla's SpmdFullyShardedDataParallel "
                        "with a shard_output of their own, which annotates the output in place "
                        "(xs.mark_sharding) and cannot run in the scan's body. Leave shard_output at its "
                        "default (the body then annotates the output as it would, functionally), or wrap the "
                        "layers' container instead of each layer.")
    annotated = _compat.xla.mark_sharding_with_gradients(first, *spec)
    return annotated if out is first else (annotated, *out[1:])


def _first_tensor(out):
    """What FSDPv2's default ``shard_output`` annotates: the output, or a tuple's first item."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple) and len(out) > 0 and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _peers_of(d):
    """A view's peers: the other layers' modules at its path. A submodule view finds them
    on first use, so one that reads no plain attribute (a Linear) reads no other layer."""
    if d["_view_peers"] is None:
        parent, name = d["_view_parent"]
        d["_view_peers"] = _compat.nn.children_named(_peers_of(parent), name)
    return d["_view_peers"]


@functools.lru_cache(maxsize=None)
def _view_type(cls):
    """A _LayerView whose ``__class__`` is ``cls``: ``isinstance`` and the
    zero-argument ``super()`` in the layer's methods then accept the view."""
    return type(f"{cls.__name__}View", (_LayerView,), {"__class__": cls})


def view_parts(view):
    """``(module, state, prefix)`` of a view: the layer it shows, the step's weights by dotted
    name, and its path in the layer (``layers.blocks`` scans a block's runs from them)."""
    d = view.__dict__
    return d["_view_m"], d["_view_state"], d["_view_prefix"]


def view_of(module, state, prefix="", peers=(), checked=None, parent=None, recorder=None):
    """The view of ``module`` (Dynamo traces the plain _LayerView only)."""
    cls = _LayerView if _compat.is_dynamo_compiling() else _view_type(type(module))
    return cls(module, state, prefix, peers, checked, parent, recorder)
