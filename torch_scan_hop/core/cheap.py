"""Eager ``remat="min_cut"``: keep what only a matmul can make, recompute the rest from recipes.

Traced, "min_cut" is functorch's partitioner: it never recomputes a matmul,
and recomputes pointwise work where that saves memory. Eager has no graph to
cut, so the same rule is applied per value, as the step runs, under a torch
function mode:

- a value computed by a function outside ``CHEAP`` (pointwise ops, views,
  reductions, norms, deterministic factories) -- a matmul, conv, attention, a
  random op, a composite function we do not know -- or computed from such a
  value, is "hot": when autograd saves it, it is kept as it is (recomputing it
  could mean a matmul or a redraw);
- any other output is "cheap": the mode records its recipe (the function and
  its arguments: constants, tensors from outside the step such as the carry, x
  and the weights, or other recipes). When autograd saves a cheap value, a
  handle to its recipe is saved instead, and the backward evaluates it (once
  per step, memoized): a few torch calls, no re-run of the body's Python, no
  tape. Under ``create_graph=True`` the recipe runs on the tape from the
  forward's own tensors, so double backward reaches the forward.

Nothing computed inside a step is held by a recipe, so a step keeps exactly
its hot saved values: on a stack of ``tanh(linear(h))`` layers one tensor per
layer (the last is the next carry) and not ``c + x``, 4 of save_all's 5 on the
benchmark body, with no matmul re-run. Saving less means recomputing matmuls
(``"recompute_all"``, ``save_only_these_names``).

In-place ops: a recipe records the value an op produced, so a value modified in
place afterwards loses its recipe (if saved later it is kept as it is), and a
tensor from outside the step that a recipe reads is checked, when the recipe
runs, not to have been modified since (a ScanError otherwise, where the plain
tape raises its version error).
"""
import torch

from .trees import ScanError


def _key(t):
    """Values are told apart by storage for hotness: a view of a hot value is hot (0 for a
    storage-less or empty tensor, never marked)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class Kept:
    """A tensor kept as it is (a hot saved value, or one from outside the step that a recipe
    reads), with the version it had: reading it checks it was not modified in place since,
    as the tape does for the values it saves."""

    __slots__ = ("t", "version")

    def __init__(self, t):
        self.t, self.version = t, t._version

    def get(self):
        if self.t._version != self.version:
            raise ScanError("scan: remat='min_cut': a tensor saved for the backward (or read to recompute one) "
                            f"was modified by an in-place operation (version {self.version} -> "
                            f"{self.t._version}); as with the plain tape, clone it before modifying it.")
        return self.t


class _Ref:
    """Output ``i`` of recipe ``rid`` of the same step."""

    __slots__ = ("rid", "i")

    def __init__(self, rid, i):
        self.rid, self.i = rid, i


class Handle:
    """What autograd saves for a cheap value: step ``pos``'s recipe ``rid``, output ``i``."""

    __slots__ = ("pos", "ref")

    def __init__(self, pos, ref):
        self.pos, self.ref = pos, ref


# Functions whose outputs are cheap to recompute from their inputs (pointwise, views, reductions,
# norms): anything else is hot, so an op this list misses is kept, never wrongly recomputed (a random
# op or a matmul hidden in a composite function included).
CHEAP = frozenset("""
    __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __neg__ __pow__ __rpow__
    __getitem__ __get__ add sub mul div neg exp exp2 log log1p expm1 tanh sigmoid sin cos relu gelu silu
    softplus elu leaky_relu hardtanh mish logsigmoid abs sqrt rsqrt square reciprocal sign erf clamp clip
    where maximum minimum pow reshape view view_as transpose permute t unsqueeze squeeze expand expand_as
    flatten contiguous cat stack split chunk unbind sum mean softmax log_softmax layer_norm rms_norm to
    float double half bfloat16 type_as zeros ones full zeros_like ones_like full_like arange
""".split())


def _mutates(name, kwargs):
    return (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") \
        or name == "__setitem__" or kwargs.get("out") is not None


class HotValues:
    """Per scan: the hot values of the step running now and every step's recipes."""

    def __init__(self):
        self.recipes = []  # per step: [(func, args, kwargs)] with tensors as Kept / _Ref
        self.hot = {}  # storage key -> tensor: this step's hot values (held: keys stay unique)
        self.cheap = {}  # id -> (_Ref, tensor, storage key): this step's cheap values (held: ids stay unique)
        self.memo_pos, self.memo = None, {}

    def start_step(self):
        self.recipes.append([])

    def end_step(self):
        self.hot, self.cheap = {}, {}

    # ---------------------------------------------------------------- forward

    def _template(self, value):
        if isinstance(value, torch.Tensor):
            entry = self.cheap.get(id(value))
            return entry[0] if entry is not None else Kept(value)
        if isinstance(value, dict):
            return {k: self._template(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(self._template(v) for v in value)
        return value

    def forward(self, func, args, kwargs):
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = _flat(args, kwargs)
        if _mutates(name, kwargs):  # the values it wrote lose their recipes
            written = {_key(t) for t in tensors}
            self.cheap = {i: e for i, e in self.cheap.items() if e[2] not in written}
        outs = [out] if isinstance(out, torch.Tensor) else \
            [o for o in out if isinstance(o, torch.Tensor)] if isinstance(out, (tuple, list)) else []
        if not outs:
            return out
        if name not in CHEAP or _mutates(name, kwargs) or any(_key(t) in self.hot for t in tensors):
            for o in outs:
                key = _key(o)
                if key:
                    self.hot[key] = o
            return out
        recipes = self.recipes[-1]
        rid = len(recipes)
        recipes.append((func, self._template(args), self._template(kwargs)))
        for i, o in enumerate([out] if isinstance(out, torch.Tensor) else out):
            if isinstance(o, torch.Tensor):
                self.cheap[id(o)] = (_Ref(rid, i), o, _key(o))
        return out

    def pack(self, t):
        """A saved value: itself when hot or from outside the step, else a handle to its recipe."""
        entry = self.cheap.get(id(t))
        if entry is None or entry[1] is not t:
            return None
        return Handle(len(self.recipes) - 1, entry[0])

    # ---------------------------------------------------------------- backward

    def value(self, handle):
        """A cheap saved value, recomputed (memoized for the step the backward is in: one step's
        cheap values are alive at a time; recipes stay, for a retained graph's next backward)."""
        pos = handle.pos
        if torch.is_grad_enabled():  # create_graph: on the tape, from the forward's own tensors
            return self._eval(pos, handle.ref, {})
        if self.memo_pos != pos:
            self.memo_pos, self.memo = pos, {}
        return self._eval(pos, handle.ref, self.memo)

    def _eval(self, pos, ref, memo):
        out = memo.get(ref.rid)
        if out is None:
            func, args, kwargs = self.recipes[pos][ref.rid]
            out = memo[ref.rid] = func(*self._fill(pos, args, memo), **self._fill(pos, kwargs, memo))
        return out if isinstance(out, torch.Tensor) else out[ref.i]

    def _fill(self, pos, value, memo):
        if isinstance(value, Kept):
            return value.get()
        if isinstance(value, _Ref):
            return self._eval(pos, value, memo)
        if isinstance(value, dict):
            return {k: self._fill(pos, v, memo) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(self._fill(pos, v, memo) for v in value)
        return value


def _flat(args, kwargs):
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


class Forward(torch.overrides.TorchFunctionMode):
    """A min_cut step's forward: marks hot values, records cheap ones' recipes. At the level of
    torch functions (``torch.tanh``, ``F.linear``), not aten ops: a dispatch mode costs ~35 us per
    op here, three times this one, which made min_cut slower than recompute_all."""

    def __init__(self, hot):
        super().__init__()
        self.hot = hot

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.hot.forward(func, args, kwargs or {})
