"""Closed-over tensors stood in for while a body is traced (``recording_functional_closures``).

make_fx cannot trace through a functional wrapper it did not create (every XLA tensor is one),
a closure batched by a vmap active before the trace, or an outer symbolic trace's value whose
sizes the re-entered tracer has never seen; the body reads stand-ins instead, and lifting
(``trace.lift``, ``trace.joint``) maps them back to the user's tensors. The private reads this
needs are ``_compat``'s adapters (``tracing``, ``dispatch``, ``functorch``).
"""
import contextlib

import torch

from .. import _compat
from .._compat import tracing as _tracing
from .closure_writes import carried_by_an_enclosing_scan


class _ClosureStandIns(torch.overrides.TorchFunctionMode):
    """Swaps closed-over functional tensors (every XLA tensor is one) for their
    unwrapped values as torch functions receive them, and remembers which is which.

    make_fx cannot trace through a functional wrapper it did not create: ops
    on it run below the tracer and their results come out untracked. The plain
    inner value traces like any constant; lifting then hands back the user's
    tensor, which keeps its autograd identity. A stand-in requires grad when
    its tensor does, so a joint trace can differentiate with respect to it.
    CPU tensors meeting XLA ones are stood in for by device copies, and closures
    batched by a vmap that was active before the trace by plain constants of
    their logical shape (``_batched_stand_in``).

    The private reads (functional wrappers, batched levels, proxy slots) are ``_compat``'s adapters.
    """

    def __init__(self):
        super().__init__()
        self._outer, self._by_id, self._moved, self.xla, self.inputs = {}, {}, {}, None, {}
        self._aliases, self._written = {}, {}
        self.vmap_levels = _tracing.active_vmap_levels()

    def _stand_in(self, t, user=None):
        if user is None and self.vmap_levels and self._batched_outside(t) and id(t) not in self.inputs:
            return self._batched_stand_in(t)
        if user is None and (not (isinstance(t, torch.Tensor) and _compat.dispatch.is_functional_tensor(t))
                             or isinstance(t, _compat.FakeTensor) or id(t) in self.inputs):
            return t
        user = t if user is None else user
        hit = self._by_id.get(id(user))
        if hit is None:
            plain = _tracing.functional_value(t)  # its value, without the wrapper
            self._outer[id(plain)] = user
            used = plain.detach().requires_grad_() if user.requires_grad else plain
            hit = self._by_id[id(user)] = (used, user, plain, t)  # plain and t kept alive: ids are keys
        return hit[0]

    def _batched_outside(self, t):
        """A closure batched by a vmap that was active before the trace began (the body
        is traced on unbatched stand-ins of its carries and x while that vmap is still
        on the interpreter stack). A vmap inside the body has a higher level."""
        level = _compat.functorch_level(t) if isinstance(t, torch.Tensor) else None
        return level is not None and level in self.vmap_levels and all(type(d) is int for d in t.shape)

    def _batched_stand_in(self, t):
        """make_fx traces the batched closure's physical value under the vmap, so the
        body's outputs came out batched, untracked: the body's graph returned them as
        constants (wrong values, silently). The body reads a plain constant of the
        closure's logical shape instead; lifting hands back the batched tensor, and
        the op's vmap rule batches the body over it, as over a batched carry."""
        hit = self._by_id.get(id(t))
        if hit is None:
            with _compat.unset_fake_temporarily(), _compat.disable_proxy_modes_tracing():
                plain = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
            self._outer[id(plain)] = t
            used = plain.requires_grad_() if t.requires_grad and plain.is_floating_point() else plain
            hit = self._by_id[id(t)] = (used, t, plain, t)
        return hit[0]

    def _onto(self, device):
        """CPU tensors meeting XLA ones move to the device, as torch_xla moves
        them per op in eager (fake tracing rejects the mix): a traced value in
        the graph, a closure as a device copy standing in for it."""
        def onto(t):
            if not _cpu_array(t) or id(t) in self.inputs:
                return t
            if isinstance(t, _compat.FakeTensor):
                return t.to(device)
            if id(t) not in self._by_id:
                with _compat.unset_fake_temporarily(), _compat.disable_proxy_modes_tracing():
                    moved = t.detach().to(device)
                self._stand_in(moved, user=t)
            return self._by_id[id(t)][0]
        return onto

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.autograd.grad:  # differentiates w.r.t. the tensors named, stand-ins or not
            return func(*args, **(kwargs or {}))
        tree_map = _compat.pytree.tree_map
        if args and writes_in_place(func) and self._is_closure(args[0]):
            self._write_stand_in(args[0])
        elif args and writes_in_place(func) and self._is_functional_closure_with_history(args[0]):
            self._write_functional_stand_in(args[0])
        if self._written:
            args, kwargs = tree_map(lambda t: self._written.get(id(t), (t,))[0], (args, kwargs or {}))
        if func in _METADATA_READS and args:
            args = (self._traced_view(args[0]), *args[1:])
            args, kwargs = tree_map(self._stand_in, (args, kwargs or {}))
        elif getattr(func, "__name__", None) == "__get__":  # an attribute read (t.layout in FX's codegen)
            args, kwargs = tree_map(self._stand_in, (args, kwargs or {}))
        else:  # an op on an outer trace's value (``v[0]`` in a nested scan's body) reads its sizes too
            args, kwargs = tree_map(self._traced_or_stood_in, (args, kwargs or {}))
        leaves = _compat.pytree.tree_leaves((args, kwargs))
        xla = next((t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "xla"), None)
        self.xla = self.xla or xla
        if self.xla is not None and any(_cpu_array(t) for t in leaves):  # also ops on CPU tensors alone
            args, kwargs = tree_map(self._onto(self.xla), (args, kwargs))
        return func(*args, **kwargs)

    def _is_closure(self, t):
        """A tensor from outside the trace (no step input, untraced), or a stand-in for one."""
        if not isinstance(t, torch.Tensor) or id(t) in self.inputs or id(t) in self._outer or _nested_stand_in(t):
            return False
        if _compat.dispatch.is_functional_tensor(t) and not isinstance(t, _compat.FakeTensor):
            return False  # (XLA) stood in for anyway (``_stand_in``): the write goes to the stand-in
        mode = _tracing.proxy_mode()
        return mode is None or not _tracing.has_proxy_slot(t, mode.tracer)

    def _write_stand_in(self, t):
        """The body writes into the closed-over ``t`` in place: from here on it reads and writes an
        alias of it (``detach()``: the same storage and version counter), which lifting maps back to
        ``t``. Written itself, ``t`` would take the trace's writes into its autograd history (a
        ``CopySlices`` of the trace's fake values, which the caller's backward then ran into: fake
        gradients); the graph is only the one finding the write (``ClosureWrites``): the scan runs
        again with ``t`` carried. A leaf that requires grad stays one, refused as the loop refuses it,
        unless an enclosing scan carries ``t`` (``t`` is then no such leaf): ``t`` reads as that scan's
        carry, a leaf in its first trace that its retry on copies (``FlatBody.copy_carry``) makes
        writable; refused in this nested trace, the write could not be retried there."""
        if id(t) in self._written:
            return
        with _compat.disable_proxy_modes_tracing():
            alias = t.detach()
            user_leaf = t.is_leaf and t.requires_grad and not carried_by_an_enclosing_scan(t)
            alias = alias.requires_grad_() if user_leaf else alias
        self._outer[id(alias)] = t
        self._written[id(t)] = (alias, t)  # t kept alive: ids are keys

    def _is_functional_closure_with_history(self, t):
        """(XLA) a closed-over functional tensor that requires grad and is no leaf (``buf = base.clone()``)."""
        return (isinstance(t, torch.Tensor) and id(t) not in self.inputs and id(t) not in self._outer
                and not _nested_stand_in(t) and _compat.dispatch.is_functional_tensor(t)
                and not isinstance(t, _compat.FakeTensor) and t.requires_grad and not t.is_leaf)

    def _write_functional_stand_in(self, t):
        """The body writes into the closed-over XLA ``t`` that requires grad and is no leaf, which the
        loop may write (its gradient reaches ``t``'s base). Its read stand-in (``_stand_in``) is a
        leaf that requires grad, which autograd refuses to write (the scan said "fn mutates its
        input"): from here on the body reads and writes a plain alias of its value instead, which
        lifting maps back to ``t``. This graph only finds the write (``ClosureWrites``): the scan
        runs again with ``t`` carried, differentiable, and its final value copied into ``t``."""
        if id(t) in self._written:
            return
        plain = _tracing.functional_value(t)
        with _compat.unset_fake_temporarily(), _compat.disable_proxy_modes_tracing():
            alias = plain.detach()
        self._outer[id(alias)] = t
        self._written[id(t)] = (alias, t, plain)  # t, plain kept alive: ids are keys

    def _traced_or_stood_in(self, t):
        """A fake value (never stood in for) as the current trace can read it; anything else stood in for."""
        return self._traced_view(t) if isinstance(t, _compat.FakeTensor) else self._stand_in(t)

    def _traced_view(self, t):
        """What a size read of ``t`` reads: ``t``, or an alias the current trace knows.

        A closure from an outer symbolic trace has sizes like ``s3`` that the
        body's own (re-entered) tracer has never seen: a body reading only
        ``W.shape[-1]`` would fail deep in torch ("s3 is not tracked with
        proxy"). One traced ``alias`` of it is a graph constant (lifted like
        any closure) whose sizes, strides and numel the trace can compute.

        None while FX writes a graph's code (the partial graph of a failed trace, printed into
        its data-dependent error): it reads each node's sizes through this mode, and an alias
        per read added a node to the graph being printed, whose printing read it in turn:
        make_fx never returned.
        """
        mode = _tracing.proxy_mode() if isinstance(t, _compat.FakeTensor) else None
        if mode is None or _tracing.has_proxy_slot(t, mode.tracer):  # traced here: its sizes are too
            return t
        key = (id(mode.tracer), id(t))
        if key not in self._aliases:
            if _tracing.printing_fx_code():
                return t
            sizes = (*t.shape, *t.stride(), t.storage_offset(), t.numel())
            if all(_tracing.get_proxy_slot(s, mode.tracer, None) is not None
                   for s in sizes if isinstance(s, torch.SymInt)):
                return t
            self._aliases[key] = (torch.ops.aten.alias.default(t), t, mode.tracer)  # t, tracer kept alive: ids are keys
        return self._aliases[key][0]

    def outer(self, t):
        """The user's tensor that stand-in ``t`` replaced (else ``t``)."""
        return self._outer.get(id(t), t)

    def inner(self, t):
        """What the body read in place of the user's ``t``: its stand-in, ``t``
        itself if it needed none, None if a functional ``t`` was never read."""
        hit = self._by_id.get(id(t))
        if hit is not None:
            return hit[0]
        return None if _compat.dispatch.is_functional_tensor(t) and not isinstance(t, _compat.FakeTensor) else t

    def op_input(self, user):
        """What the op receives for the user's closure ``user``. A CPU closure
        that requires grad in a body on XLA becomes a differentiable copy on
        the device: its gradient comes back to it through the copy, and the
        body's backward stays on one device (autograd would run CPU nodes on
        another thread, both dispatching into one fake mode while partitioning)."""
        if self.xla is None or user.device.type != "cpu" or not user.requires_grad or isinstance(user, _compat.FakeTensor):
            return user
        if id(user) not in self._moved:
            with _compat.disable_proxy_modes_tracing(), torch.enable_grad():
                self._moved[id(user)] = user.to(self.xla)
        return self._moved[id(user)]


_METADATA_READS = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.stride, torch.Tensor.storage_offset,
    torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.__len__,
})


_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__",
                               "__iand__"})


def writes_in_place(func):
    """Does ``func`` write into its first argument (``t.add_``, ``t[i] = v``, ``aten.index_put_``)?"""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return bool(schema.arguments) and schema.arguments[0].alias_info is not None \
            and schema.arguments[0].alias_info.is_write
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _cpu_array(t):
    """A CPU tensor with dims: fake tracing lets only 0-dim ones mix with XLA tensors."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0


_recording = []  # the stand-in modes of the traces under way, outermost first (nested scans' bodies)


def _nested_stand_in(t):
    """Is ``t`` a stand-in that one of the traces under way made for a closure?

    A nested scan's body (``remat="sqrt"``'s blocks, a scan in a scan) is traced under the outer
    body's mode too, which sees the ops the nested body's mode hands on: a write into the nested
    mode's stand-in, which that mode lifts back to the user's tensor. Taken for a closure, it was
    stood in for again: the nested graph wrote into a tensor neither mode maps back to the user's,
    and the nested scan, carrying that tensor, found the body's write again on every trace.
    Each mode keeps its stand-ins alive, so their ids are keys."""
    return any(id(t) in mode._outer for mode in _recording)


@contextlib.contextmanager
def recording_functional_closures(tensors=()):
    """Yields the stand-in mode: ``.outer(t)`` / ``.inner(t)`` map between the
    user's closures and what the traced body read, ``.op_input(t)`` says what
    the op receives for a closure. With XLA ``tensors`` (the step's inputs),
    every CPU tensor the body touches is on the device from the start
    (see ``_ClosureStandIns``)."""
    mode = _ClosureStandIns()
    mode.xla = next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"), None)
    mode.inputs = {id(t): t for t in tensors}  # the step's own inputs are traced, not stood in for
    _recording.append(mode)
    try:
        with mode:
            yield mode
    finally:
        _recording.remove(mode)
