"""Eager remat by recipes: recompute a step's saved values from recorded calls, not by re-running the body.

Each step runs on the tape under a torch function mode that records, for every
function it calls, a recipe: the function and its arguments (constants, tensors
from outside the step such as the carry, x and the weights, or other recipes).
When autograd saves a recorded value, a handle to its recipe is saved instead,
unless the step keeps the value (``seeds``); the backward evaluates the recipes
a step's saved values need (memoized per step), stopping at kept values: a few
torch calls, no re-run of the body's Python, no tape. Under
``create_graph=True`` the recipes run on the tape from the forward's own
tensors, so double backward reaches the forward. What a step keeps:

- ``"recompute_all"``: only its new carry (kept by the engine anyway). A
  function outside ``DETERMINISTIC`` (a random op) or an in-place one turns
  recipes off (``usable``): the engine re-runs the body for what is saved after;
- ``save_only_these_names``: the named values besides (the engine's ``named``);
- an op-level policy (``dots_saveable``, a user's ``RematPolicy``): the outputs of the calls that
  run an op it saves (``remat/policy_ops.py``) and the values it names, where the backward reads them;
- ``"min_cut"``: besides the carry, what its plan says (``remat/keep.py``): at
  most half of the bytes save_all keeps, for the least recompute. A value made
  by a function outside ``DETERMINISTIC``, or computed from one, is "hot": kept
  as it is when saved (recomputing it could mean a redraw), never recorded.

In-place ops: a recipe records the value an op produced, so a value modified in
place afterwards loses its recipe (if saved later it is kept as it is); a tensor
from outside the step that a recipe reads and the step then writes (its carry) is
read as a copy taken before the write (``_read_before``); one written later (by
another step) is a ScanError when the recipe runs, where the tape raises its own.
"""
import torch

from ..core.trees import ScanError
from . import keep


def storage_key(t):
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
            raise ScanError("scan: remat: a tensor saved for the backward (or read to recompute one) "
                            f"was modified by an in-place operation (version {self.version} -> "
                            f"{self.t._version}); as with the plain tape, clone it before modifying it.")
        return self.t


class _Ref:
    """Output ``i`` of recipe ``rid`` of the same step."""

    __slots__ = ("i", "rid")

    def __init__(self, rid, i):
        self.rid, self.i = rid, i


class Handle:
    """What autograd saves for a cheap value: step ``pos``'s recipe output ``ref``. A value saved
    while its op runs (an output, as tanh saves its result) is ``kept`` until the op returns and
    its recipe exists; one that never gets a recipe (made inside a composite op) stays kept."""

    __slots__ = ("kept", "pos", "ref")

    def __init__(self, pos, ref, kept=None):
        self.pos, self.ref, self.kept = pos, ref, kept


# Functions whose outputs are cheap to recompute from their inputs (pointwise, views, reductions,
# norms): min_cut's plan prices them by the elements they make (remat/keep.py).
CHEAP = frozenset((
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__neg__", "__pow__", "__rpow__", "__getitem__", "__get__", "add", "sub", "mul", "div", "neg", "exp",
    "exp2", "log", "log1p", "expm1", "tanh", "sigmoid", "sin", "cos", "relu", "gelu", "silu", "softplus",
    "elu", "leaky_relu", "hardtanh", "mish", "logsigmoid", "abs", "sqrt", "rsqrt", "square", "reciprocal",
    "sign", "erf", "clamp", "clip", "where", "maximum", "minimum", "pow", "reshape", "view", "view_as",
    "transpose", "permute", "t", "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "contiguous",
    "cat", "stack", "split", "chunk", "unbind", "sum", "mean", "softmax", "log_softmax", "layer_norm",
    "rms_norm", "to", "float", "double", "half", "bfloat16", "type_as", "zeros", "ones", "full",
    "zeros_like", "ones_like", "full_like", "arange",
))


# Deterministic functions that are not cheap (priced DOT_WEIGHT times more). A function outside both
# lists, a random op say or a composite we do not know, is never recorded: it sends recompute_all and
# names back to re-running the body, and min_cut keeps its outputs (and what is computed from them).
DOTS = frozenset((
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addmv", "mv", "dot",
    "einsum", "conv1d", "conv2d", "conv3d", "bilinear", "embedding",
))
DETERMINISTIC = CHEAP | DOTS
VIEWS = frozenset(("__getitem__", "reshape", "view", "view_as", "transpose", "permute", "t", "unsqueeze", "squeeze",
                   "expand", "expand_as", "flatten", "split", "chunk", "unbind"))  # free to recompute, never kept


class HotValues:
    """Per scan: every step's recipes and kept values (``seeds``), the step running now's hot values.

    ``recompute=True`` serves ``recompute_all`` and names: every deterministic function gets a
    recipe (nothing is hot); the first function outside ``DETERMINISTIC`` (or an in-place one)
    turns recipes off (``usable``) and the engine re-runs the body for the values saved after.
    ``budget`` serves ``min_cut``: values that cannot be recorded are hot, each step keeps what
    its plan says (remat/keep.py)."""

    def __init__(self, recompute=False, budget=None, keeps=None):
        self.recompute, self.usable = recompute, True
        self.keeps = keeps  # an op-level policy's ``policy_ops.OpKeeps``: which calls' outputs a step keeps
        self.policy_kept = []  # this step's recipe ids kept for the policy
        self.saved_rids = set()  # with ``keeps``: this step's recipe ids autograd saved
        self.snapshot = self.on_unusable = None  # the engine's: RNG state now; "recipes stop here"
        self.budget = budget  # min_cut: keep at most this share of save_all's bytes per step (remat/keep.py)
        self.plans = {}  # min_cut: step shape -> recipe ids to keep
        self.saved = []  # min_cut: this step's saved values, (recipe id or None for a hot one, tensor)
        self.seeds = []  # per step: recipe id -> Kept value (the new carry, named or planned values)
        self.kinds = {}  # function -> _kind
        self.recipes = []  # per step: [(func, args, kwargs)] with tensors as Kept / _Ref
        self.hot = {}  # storage key -> tensor: this step's hot values (held: keys stay unique)
        self.cheap = {}  # id -> (_Ref, tensor, single output): this step's cheap values (held: ids stay unique)
        self.memo_pos, self.memo = None, {}
        self.pending = []  # (handle, tensor) saved while an op runs, resolved when it returns
        self.writing = None  # while an in-place call runs: the storage keys it may write

    def start_step(self):
        self.recipes.append([])
        self.seeds.append({})

    def end_step(self, new_carry=()):
        carries = set()
        for leaf in new_carry:
            entry = self.cheap.get(id(leaf))
            if entry is not None and entry[1] is leaf and entry[2]:
                self.seeds[-1][entry[0].rid] = Kept(leaf)
                carries.add(entry[0].rid)
        if self.policy_kept:
            self._drop_unread(carries)
        if self.budget is not None and self.recipes:
            self._keep_planned()
        self.hot, self.cheap, self.pending = {}, {}, None
        self.saved = []
        self.saved_rids = set()

    def _drop_unread(self, carries):
        """An op-level policy keeps a value only where the backward reads it (as the traced partition
        saves what the backward needs): one the step's saved values do not lead to is dropped."""
        recipes, seeds = self.recipes[-1], self.seeds[-1]
        marked = set(self.saved_rids)
        for rid in range(max(marked, default=-1), -1, -1):
            if rid in marked and rid not in seeds:
                keep.parents(recipes[rid][1:], marked)
        for rid in self.policy_kept:
            if rid not in marked and rid not in carries:
                seeds.pop(rid, None)  # (already dropped if written in place)
        self.policy_kept = []

    def keep(self, t):
        """Keep ``t`` for the backward as it is (a named value): the recipes that read it stop there."""
        entry = self.cheap.get(id(t))
        if entry is not None and entry[1] is t and entry[2]:
            self.seeds[-1][entry[0].rid] = Kept(t)

    def _keep_planned(self):
        """min_cut: keep the values the step's plan names (``seeds``: the backward reads them as they
        are); the rest of what the backward needs is recomputed from recipes."""
        recipes, seeds, saved = self.recipes[-1], self.seeds[-1], self.saved
        shape = (tuple([r[0] for r in recipes]), tuple([rid for rid, _ in saved]), tuple(seeds))
        plan = self.plans.get(shape)
        if plan is None:  # once per scan call; the search once per process and step shape and sizes
            key = (shape, tuple([t.untyped_storage().nbytes() for _, t in saved]))
            plan = keep.PLANS.get(key)
            if plan is None:
                plan = keep.remember(key, self._plan(recipes, seeds, saved))
            self.plans[shape] = plan
        if plan:
            outputs = {e[0].rid: e[1] for e in self.cheap.values() if e[2]}
            for rid in plan:
                t = outputs.get(rid)
                if t is not None:
                    seeds[rid] = Kept(t)

    def _plan(self, recipes, seeds, saved):
        """The recipe ids this step shape keeps (remat/keep.py), from the bytes save_all would keep."""
        outputs = {e[0].rid: e[1] for e in self.cheap.values() if e[2]}
        saved_bytes = {storage_key(t): t.untyped_storage().nbytes() for _, t in saved}
        saved_bytes.pop(0, None)
        costs = [0] * len(recipes)
        for ref, t, _ in self.cheap.values():
            _, is_cheap, _ = self._kind(recipes[ref.rid][0])
            view = getattr(recipes[ref.rid][0], "__name__", "") in VIEWS
            costs[ref.rid] += 0 if view else t.numel() * (1 if is_cheap else keep.DOT_WEIGHT)
        anyway = {storage_key(t) for rid, t in saved if rid is None} | {storage_key(k.t) for k in seeds.values()}
        budget = keep.BUDGET * sum(saved_bytes.values()) - sum(n for k, n in saved_bytes.items() if k in anyway)
        sizes = {rid: t.untyped_storage().nbytes() for rid, t in outputs.items()
                 if rid not in seeds and getattr(recipes[rid][0], "__name__", "") not in VIEWS}
        needed = {rid for rid, _ in saved if rid is not None} - set(seeds)
        return keep.choose(recipes, needed, set(seeds), costs, sizes, budget)

    # ---------------------------------------------------------------- forward

    def _template(self, value):
        if isinstance(value, torch.Tensor):
            entry = self.cheap.get(id(value))
            return entry[0] if entry is not None and entry[1] is value else Kept(value)
        if type(value) is tuple:  # the common case: a function's positional arguments
            return tuple([self._template(v) for v in value])
        if isinstance(value, dict):
            return {k: self._template(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)([self._template(v) for v in value])
        return value

    def forward(self, func, args, kwargs):
        kind = self.kinds.get(func) or self._kind(func)
        writes = kind[0] or (bool(kwargs) and kwargs.get("out") is not None)
        if writes:  # (the tensor written: the first argument, or every one for out=)
            target = args[0] if args and isinstance(args[0], torch.Tensor) else None
            self._read_before({storage_key(target)} - {0} if target is not None else
                              {storage_key(t) for t in _flat(args, kwargs)} - {0})
        if not self.usable:  # (the step's recipes so far still serve its values saved so far)
            return func(*args, **kwargs)
        before = None
        if self.recompute and self.snapshot is not None and (writes or not kind[2]):  # may stop the recipes
            before = self.snapshot()
        pending = self.pending = []
        self.writing = {storage_key(t) for t in _flat(args, kwargs)} if writes else None
        try:
            if self.keeps is not None and not writes and kind[2]:
                out, kept = self.keeps.call(func, args, kwargs)
            else:
                out, kept = func(*args, **kwargs), False
            self._record(func, args, kwargs, out, writes, kind[2], kept)
            if before is not None and not self.usable:
                self.on_unusable(before)
            for handle, t in pending:
                entry = self.cheap.get(id(t))
                if entry is not None and entry[1] is t:
                    handle.ref, handle.kept = entry[0], None
                    if self.keeps is not None:
                        self.saved_rids.add(entry[0].rid)
                    if self.budget is not None:
                        self.saved.append((entry[0].rid, t))
        finally:
            self.pending = self.writing = None
        return out

    def _read_before(self, written):
        """An in-place call is about to write tensors from outside the step (the carry it was given, a
        carried buffer) that this step's recipes read: they read a copy taken now, the value the
        forward read (the loop's tape saved nothing of them: it has no error to raise)."""
        copies = {}

        def fresh(v):
            if isinstance(v, Kept):
                if storage_key(v.t) in written and id(v.t) not in copies:
                    copies[id(v.t)] = Kept(v.t.detach().clone())
                return copies.get(id(v.t), v) if storage_key(v.t) in written else v
            if isinstance(v, (tuple, list, dict)):
                new = {k: fresh(u) for k, u in (v.items() if isinstance(v, dict) else enumerate(v))}
                same = all(new[k] is u for k, u in (v.items() if isinstance(v, dict) else enumerate(v)))
                return v if same else new if isinstance(v, dict) else type(v)(new.values())
            return v

        recipes = self.recipes[-1] if self.recipes else ()
        for rid, (func, args, kwargs) in enumerate(recipes):
            recipes[rid] = (func, fresh(args), fresh(kwargs) if kwargs else kwargs)

    def _kind(self, func):
        """(writes in place, cheap, deterministic) by the function's name, once per function."""
        kind = self.kinds.get(func)
        if kind is None:
            name = getattr(func, "__name__", "")
            writes = (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") \
                or name == "__setitem__"
            kind = self.kinds[func] = (writes, name in CHEAP, name in DETERMINISTIC)
        return kind

    def _record(self, func, args, kwargs, out, writes, deterministic, kept=False):
        if writes:  # the values it wrote lose their recipes, and are no longer what this step kept of them
            written = self.writing
            self.cheap = {i: e for i, e in self.cheap.items() if storage_key(e[1]) not in written}
            seeds = self.seeds[-1]
            for rid in [rid for rid, k in seeds.items() if storage_key(k.t) in written]:
                del seeds[rid]  # its recipe still gives the value its consumers so far read
        single = isinstance(out, torch.Tensor)
        if not single and not (isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)):
            return
        if self.recompute:
            if writes or not deterministic:
                self.usable = False
                return
        elif writes or not deterministic or (self.hot and any(storage_key(t) in self.hot for t in _flat(args, kwargs))):
            for o in [out] if single else out:
                key = storage_key(o) if isinstance(o, torch.Tensor) else 0
                if key:
                    self.hot[key] = o
            return
        recipes = self.recipes[-1]
        rid = len(recipes)
        recipes.append((func, self._template(args), self._template(kwargs) if kwargs else kwargs))
        if single:
            self.cheap[id(out)] = (_Ref(rid, 0), out, True)
            if kept:  # an op-level policy's: the backward reads it as it is (multi-output calls: recomputed)
                self.seeds[-1][rid] = Kept(out)
                self.policy_kept.append(rid)
            return
        for i, o in enumerate(out):
            if isinstance(o, torch.Tensor):
                self.cheap[id(o)] = (_Ref(rid, i), o, False)

    def pack(self, t):
        """A saved value: itself when hot or from outside the step, else a handle to its recipe. A value
        an in-place call saves of what it writes (``sigmoid_`` its result) is kept as it is: its
        recipe is the value before the write."""
        if self.writing is not None and storage_key(t) in self.writing:
            if self.budget is not None:
                self.saved.append((None, t))
            return None
        entry = self.cheap.get(id(t))
        if entry is not None and entry[1] is t:
            if self.budget is not None:  # min_cut: what save_all would keep, which recipes it reads
                self.saved.append((entry[0].rid, t))
            elif self.keeps is not None:
                self.saved_rids.add(entry[0].rid)
            return Handle(len(self.recipes) - 1, entry[0])
        hot = bool(self.hot) and self.is_hot(t)
        if self.pending is not None and not hot and not t.is_leaf:  # saved inside an op: maybe its output
            handle = Handle(len(self.recipes) - 1, None, Kept(t))
            self.pending.append((handle, t))
            return handle
        if hot and self.budget is not None:
            self.saved.append((None, t))
        return None

    def is_hot(self, t):
        key = storage_key(t)
        return key != 0 and key in self.hot

    # ---------------------------------------------------------------- backward

    def value(self, handle):
        """A cheap saved value, recomputed (memoized for the step the backward is in: one step's
        cheap values are alive at a time; recipes stay, for a retained graph's next backward)."""
        if handle.kept is not None:
            return handle.kept.get()
        pos = handle.pos
        if torch.is_grad_enabled():  # create_graph: on the tape, from the forward's own tensors
            return self._eval(pos, handle.ref, {})
        if self.memo_pos != pos:
            self.memo_pos, self.memo = pos, {}
        return self._eval(pos, handle.ref, self.memo)

    def _eval(self, pos, ref, memo):
        out = memo.get(ref.rid)
        if out is None:
            kept = self.seeds[pos].get(ref.rid)  # checked: the tape would refuse a value modified since
            out = kept.get() if kept is not None else None
        if out is None:
            func, args, kwargs = self.recipes[pos][ref.rid]
            out = memo[ref.rid] = func(*self._fill(pos, args, memo), **self._fill(pos, kwargs, memo))
        return out if isinstance(out, torch.Tensor) else out[ref.i]

    def _fill(self, pos, value, memo):
        if isinstance(value, Kept):
            return value.get()
        if isinstance(value, _Ref):
            return self._eval(pos, value, memo)
        if type(value) is tuple:
            return tuple([self._fill(pos, v, memo) for v in value])
        if isinstance(value, dict):
            return {k: self._fill(pos, v, memo) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)([self._fill(pos, v, memo) for v in value])
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
