"""Caches that keep a repeated scan call from re-tracing its body.

Two levels, both dropped when anything they depend on may have changed:

* ``traced_body``: user ``fn`` + input metadata -> (lifted GraphModule, lifted
  tensors, y spec). The key is what fn computes, not the fn object: its code,
  the values it closes over, the globals it reads, the parameters/buffers and
  plain attributes of modules it reaches. A fresh ``lambda`` per call over the
  same weights therefore hits. Objects are keyed by identity and guarded by a
  weak reference, so a freed object whose id is reused never matches. fn that
  reaches values we cannot fingerprint is simply never cached.
* ``plan_for``: (body graph, input metadata incl. requires_grad, reverse,
  remat) -> the autograd plan (partitioned fwd/bwd graphs), stored per body
  object in a weak dictionary.

Both are bypassed while a tracer (make_fx, fake mode, Dynamo) is active: a
trace runs once anyway, and its tensors must not outlive it.
"""
import collections
import types
import weakref

import torch

_MAX_ENTRIES = 64
_MAX_DEPTH = 4
_MAX_ITEMS = 512
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_OPAQUE = (types.ModuleType, type, types.BuiltinFunctionType, types.BuiltinMethodType,
           types.MethodWrapperType, types.WrapperDescriptorType, torch._ops.OpOverloadPacket,
           torch._ops.OpOverload)


class _Uncacheable(Exception):
    pass


class _Fingerprint:
    """Builds a hashable key for a value; collects the objects keyed by id."""

    def __init__(self):
        self.refs, self.items = [], 0

    def identity(self, v):
        try:
            self.refs.append(weakref.ref(v))
        except TypeError:
            raise _Uncacheable from None
        return id(v)

    def key(self, v, depth=0):
        self.items += 1
        if depth > _MAX_DEPTH or self.items > _MAX_ITEMS:
            raise _Uncacheable
        if isinstance(v, _SCALARS):
            return (type(v), v)
        if isinstance(v, torch.Tensor):
            return ("tensor", self.identity(v), tuple(v.shape), v.dtype, v.device)
        if isinstance(v, _OPAQUE):  # never change meaning while alive
            return ("opaque", self.identity(v) if _weakrefable(v) else id(v))
        if isinstance(v, (tuple, list)):
            return (type(v), tuple(self.key(e, depth + 1) for e in v))
        if isinstance(v, dict):
            return (type(v), tuple((self.key(k, depth + 1), self.key(e, depth + 1)) for k, e in v.items()))
        if isinstance(v, types.FunctionType):
            return self.function(v, depth)
        if isinstance(v, types.MethodType):
            return ("method", self.key(v.__func__, depth + 1), self.key(v.__self__, depth + 1))
        if isinstance(v, torch.nn.Module):
            return self.module(v, depth)
        if hasattr(v, "__dict__"):
            return ("obj", type(v), self.identity(v), self.key(vars(v), depth + 1))
        raise _Uncacheable

    def function(self, fn, depth):
        code = fn.__code__
        cells = tuple(self.key(c.cell_contents, depth + 1) if _cell_full(c) else "<empty>"
                      for c in fn.__closure__ or ())
        glb = fn.__globals__
        names = tuple((n, self.key(glb[n], depth + 1)) for n in _global_names(code) if n in glb)
        return ("fn", code, cells, names, self.key(fn.__defaults__, depth + 1),
                self.key(fn.__kwdefaults__, depth + 1))

    def module(self, m, depth):
        parts = []
        for name, sub in m.named_modules():
            plain = tuple((k, self.key(v, depth + 1)) for k, v in vars(sub).items()
                          if not k.startswith("_") and k != "training")
            tensors = tuple((k, self.identity(t), tuple(t.shape), t.dtype)
                            for k, t in (*sub._parameters.items(), *sub._buffers.items()) if t is not None)
            parts.append((name, type(sub), sub.training, plain, tensors))
        return ("module", self.identity(m), tuple(parts))


def _weakrefable(v):
    try:
        weakref.ref(v)
        return True
    except TypeError:
        return False


def _cell_full(cell):
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def _global_names(code):
    """Names ``code`` (and the functions defined inside it) may read as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return sorted(set(names))


def fingerprint(value):
    """(hashable key, weak refs that must stay alive), or None if uncacheable."""
    fp = _Fingerprint()
    try:
        key = fp.key(value)
        hash(key)
    except (_Uncacheable, TypeError, RecursionError):
        return None
    return key, fp.refs


def _ambient_state():
    """Global state that changes what a trace records."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def tensor_meta(tensors, with_grad=False, drop_lead=False):
    """Shapes/dtypes/devices (and requires_grad); ``drop_lead`` keys xs by their
    slice shape: the body never sees the length, so a new length reuses it."""
    start = 1 if drop_lead else 0
    return tuple((tuple(t.shape[start:]), t.dtype, t.device, t.requires_grad if with_grad else None)
                 for t in tensors)


_traced = collections.OrderedDict()


def lookup_traced(key):
    """The cached (gm, lifted, y_spec) for key, or None if missing or stale."""
    entry = _traced.get(key)
    if entry is None:
        return None
    refs, gm, lifted_refs, lifted_meta, y_spec = entry
    lifted = [r() for r in lifted_refs]
    if any(r() is None for r in refs) or any(t is None for t in lifted) or tensor_meta(lifted) != lifted_meta:
        del _traced[key]
        return None
    _traced.move_to_end(key)
    return gm, lifted, y_spec


def store_traced(key, refs, gm, lifted, y_spec):
    try:
        lifted_refs = [weakref.ref(t) for t in lifted]
    except TypeError:
        return
    _traced[key] = (refs, gm, lifted_refs, tensor_meta(lifted), y_spec)
    while len(_traced) > _MAX_ENTRIES:
        _traced.popitem(last=False)


def body_key(fn, inputs):
    """Key of a user fn applied to inputs like these, or None if uncacheable."""
    fp = fingerprint(fn)
    if fp is None:
        return None
    key, refs = fp
    meta = (inputs.init_spec, inputs.xs_spec, tensor_meta(inputs.init_leaves),
            tensor_meta(inputs.xs_leaves, drop_lead=True))
    return (key, meta, _ambient_state()), refs


_memos = weakref.WeakKeyDictionary()


def memo(owner, key, build):
    """``build()`` once per (owner object, key); forgotten with the owner.

    Owners that cannot be weakly referenced (or keys that cannot be hashed)
    are not cached: build() runs every time.
    """
    try:
        per_owner = _memos.setdefault(owner, {})
        hash(key)
    except TypeError:
        return build()
    value = per_owner.get(key)
    if value is None:
        value = per_owner[key] = build()
    return value


def plan_for(combine_fn, init, xs, additional_inputs, reverse, remat, build):
    """The autograd plan, once per (body object, per-step input metadata, reverse, remat)."""
    meta = (tensor_meta(init, True), tensor_meta(xs, True, drop_lead=True), tensor_meta(additional_inputs, True))
    key = ("plan", meta, reverse, remat, _ambient_state())
    return memo(combine_fn, key, build)


def clear():
    """Forget every cached trace and plan (e.g. after monkey-patching a body's helpers)."""
    _traced.clear()
    _memos.clear()
