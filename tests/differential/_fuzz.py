"""Seeded random scan problems for tests/differential/test_differential.py.

A problem is everything one integer seed decides: pytrees of float/int/bool
leaves for the carry and xs, closed-over tensors (used 0-3 times), maybe an
nn.Module, scan's options, and a body written as Python source from a small op
vocabulary (so a failure prints the exact body). ``materialize`` builds fresh,
identical tensors for it every call; ``loop`` is the Python for-loop it must match.
"""
import collections
import dataclasses
import linecache
import math
import os
import random

import torch
import torch.utils._pytree as pytree
from conftest import reference_scan

import _fuzz_writes

B, D = 2, 3  # the body works on (B, D) float values
# where problems live (loop and scan alike): SCAN_FUZZ_DEVICE=cuda runs the differential suite on a GPU
FUZZ_DEVICE = os.environ.get("SCAN_FUZZ_DEVICE", "cpu")
Pair = collections.namedtuple("Pair", ["a", "b"])
PER_STEP = {"BD": (B, D), "D": (D,), "B": (B,), "S": ()}
TO_BD = {(B, D): "{}", (D,): "{}.expand(2, 3)", (): "{}.expand(2, 3)", (B,): "{}.unsqueeze(-1).expand(2, 3)"}
# LayerNorm's eps is 1e-3, not 1e-5: the bodies often normalize rows broadcast from fewer values
# (TO_BD's expands), whose variance is 0; the output is then rounding noise times 1/sqrt(eps), and
# at 1e-5 that noise (3e-5 in float32) differs between any two correct reduction orders.
MODULES = ["torch.nn.Linear(3, 3)", "torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())",
           "torch.nn.LayerNorm(3, eps=1e-3)"]
REMATS = ["save_all", "min_cut", "recompute_all", "default_partition", "sqrt"]  # sqrt traced: two scans


@dataclasses.dataclass(frozen=True)
class Leaf:
    kind: str  # "float", "int" or "bool"
    shape: tuple  # per-step shape
    grad: bool = False  # requires_grad (float inputs only)

    def dtype(self, float_dtype):
        return {"float": float_dtype, "int": torch.int64, "bool": torch.bool}[self.kind]


@dataclasses.dataclass
class Problem:
    seed: int
    dtype: torch.dtype
    length: int
    reverse: bool
    dim: int
    remat: str
    unroll: object
    pass_length: bool
    carry: object  # pytree of Leaf
    xs: object  # pytree of Leaf, or None (then length= is passed)
    closures: list  # (name, shape, requires_grad, uses)
    module: object  # source of an nn.Module called `lin` in the body, or None
    source: str  # `def make_body(*closures, *buffers, lin): ... return body`
    writes: object = None  # _fuzz_writes.Writes: in-place writes, or None

    def kwargs(self, text=False):
        remat = self.remat
        if remat == "default_partition" and not text:
            from torch._functorch.partitioners import default_partition as remat
        kw = dict(reverse=self.reverse, dim=self.dim, remat=remat, unroll=self.unroll)
        if self.writes is not None and self.writes.index:
            kw["with_index"] = True
        if self.xs is None or self.pass_length:
            kw["length"] = self.length
        return kw

    def with_length(self, length):
        return dataclasses.replace(self, length=length)

    def describe(self):
        def fmt(tree, full):
            return str(tmap(lambda l: _LeafText(l, self, full), tree))
        return "\n".join([
            f"seed {self.seed}: scan(body, init, xs, {', '.join(f'{k}={v!r}' for k, v in self.kwargs(True).items())})",
            f"  init: {fmt(self.carry, False)}",
            f"  xs:   {fmt(self.xs, True)}",
            *[f"  closure {n}: {_dt(self.dtype)}{list(s)}{' requires_grad' if g else ''}, used {u}x"
              for n, s, g, u in self.closures],
            f"  lin = {self.module}" if self.module else "  (no module)",
            *([self.writes.describe()] if self.writes else []), self.source])


def tmap(fn, tree):
    """tree_map that leaves None (a leaf to torch's pytree) alone."""
    return pytree.tree_map(lambda v: None if v is None else fn(v), tree)


def tensors(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _dt(dtype):
    return str(dtype).replace("torch.", "")


class _LeafText:
    def __init__(self, leaf, p, full):
        self.text = f"{_dt(leaf.dtype(p.dtype))}{list(full_shape(p, leaf) if full else leaf.shape)}"
        self.text += " grad" if leaf.grad else ""

    def __repr__(self):
        return self.text


def full_shape(p, leaf):
    pos = p.dim if p.dim >= 0 else p.dim + len(leaf.shape) + 1
    return leaf.shape[:pos] + (p.length,) + leaf.shape[pos:]


# ---------------------------------------------------------------- generation

def gen_tree(rng, make_leaf, depth=0, none_ok=True):
    r = rng.random()
    if depth > 0 and none_ok and r < 0.08:
        return None
    if depth >= 2 or r < 0.4:
        return make_leaf()
    kind = rng.choice(["dict", "tuple", "list", "Pair"])
    n = 2 if kind == "Pair" else rng.randint(1, 3)
    kids = [gen_tree(rng, make_leaf, depth + 1, none_ok) for _ in range(n)]
    if kind == "dict":
        return {k: v for k, v in zip("hcn", kids)}
    return Pair(*kids) if kind == "Pair" else (tuple(kids) if kind == "tuple" else kids)


def leaf_paths(tree, root):
    """[(python expression, Leaf)] for every leaf of a Leaf pytree."""
    if isinstance(tree, Leaf):
        return [(root, tree)]
    if tree is None:
        return []
    if isinstance(tree, dict):
        items = [(f"{root}[{k!r}]", v) for k, v in tree.items()]
    elif isinstance(tree, Pair):
        items = [(f"{root}.{f}", getattr(tree, f)) for f in Pair._fields]
    else:
        items = [(f"{root}[{i}]", v) for i, v in enumerate(tree)]
    return [pl for path, sub in items for pl in leaf_paths(sub, path)]


def render(tree, leaf_src):
    """Python source building `tree` (same containers) with leaf_src(leaf) at each leaf."""
    if tree is None:
        return "None"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {render(v, leaf_src)}" for k, v in tree.items()) + "}"
    if isinstance(tree, Pair):
        return f"Pair({render(tree.a, leaf_src)}, {render(tree.b, leaf_src)})"
    if isinstance(tree, (tuple, list)):
        inner = ", ".join(render(v, leaf_src) for v in tree) + ("," if isinstance(tree, tuple) and len(tree) == 1 else "")
        return f"({inner})" if isinstance(tree, tuple) else f"[{inner}]"
    return leaf_src(tree)


def generate(seed):
    rng = random.Random(seed)
    dtype = rng.choice([torch.float64, torch.float64, torch.float32])

    def carry_leaf():
        kind = rng.choices(["float", "int", "bool"], [7, 2, 1])[0]
        if kind != "float":
            return Leaf(kind, ())
        return Leaf("float", PER_STEP[rng.choice(list(PER_STEP))], rng.random() < 0.7)

    def x_leaf():
        if rng.random() < 0.2:
            return Leaf("int", (B,))
        return Leaf("float", PER_STEP[rng.choice(list(PER_STEP))], rng.random() < 0.6)

    carry = gen_tree(rng, carry_leaf, none_ok=rng.random() < 0.2)
    xs = None if rng.random() < 0.15 else gen_tree(rng, x_leaf)
    if xs is not None and not leaf_paths(xs, "x"):
        xs = None
    length = rng.choice([0, 1, 1, 2, 3, 4, 5, 5, 7, 9])
    dim = 0
    if xs is not None and rng.random() < 0.35:
        nd = min(len(l.shape) for _, l in leaf_paths(xs, "x"))
        dim = rng.choice([d for d in range(-nd - 1, nd + 1) if d != 0] or [0])
    closures = []
    for i in range(rng.choice([0, 1, 1, 2, 3])):
        shape = (D, D) if rng.random() < 0.6 else (D,)
        closures.append((f"{'W' if len(shape) == 2 else 'b'}{i}", shape, rng.random() < 0.6, rng.choice([0, 1, 1, 2, 3])))
    module = rng.choice(MODULES) if rng.random() < 0.4 else None
    p = Problem(seed, dtype, length, rng.random() < 0.5, dim, rng.choices(REMATS, [3, 3, 3, 1, 2])[0],
                rng.choice([None, None, 1, 2, 3, 4]), rng.random() < 0.2, carry, xs, closures, module, "")
    p.writes = _fuzz_writes.draw(seed, leaf_paths(carry, "carry"))  # its own generator
    writer = (_WritingBody if p.writes else _BodyWriter)(rng, p)
    writer.wr = _fuzz_writes.rng(seed)
    p.source = writer.source()
    return p


class _BodyWriter:
    """Writes `make_body`: read leaves as (2, 3) values, apply random ops, write the outputs."""

    def __init__(self, rng, p):
        self.rng, self.p, self.lines, self.floats = rng, p, [], []
        self.ints, self.bools, self.x_paths = [], [], []

    def new(self, expr):
        name = f"v{len(self.floats)}"
        self.lines.append(f"{name} = {expr}")
        self.floats.append(name)
        return name

    def pick(self):
        return self.rng.choice(self.floats[-3:] if self.rng.random() < 0.7 else self.floats)

    # Comparisons cut at 0.0123, not 0: bodies make exact zeros by structure (a layer_norm row's
    # sum or middle entry, a cancelling difference), whose sign is then rounding, and XLA, inductor
    # and eager round differently. No op makes 0.0123 exactly. For the same reason argmax ys
    # break ties (a row of structural zeros) by position, 0.0123 apart.
    def op(self):
        r, a, b, c = self.rng, self.pick(), self.pick(), self.pick()
        ops = ["torch.tanh({a})", "torch.sigmoid({a})", "{a} + {b}", "{a} * {b}", "{a} * 0.5 - 0.25",
               "{a}.sum(-1, keepdim=True) * 0.3 + {b}", "{a}.mean(0, keepdim=True).expand(2, 3)",
               "torch.where({a} > 0.0123, {b}, {c})", "torch.cat([{a}, {b}], -1)[:, 1:4]",
               "torch.stack([{a}, {b}]).sum(0)", "{a}[:, %s]" % r.sample(range(3), 3), "{a}.flip(-1)",
               "{a}.roll(1, 0)", "{a}.to(torch.%s).to(%s)" % (r.choice(["float64", "float32"]), self.dt()),
               "({a} > 0.0123).to(%s) * {b}" % self.dt(), "torch.softmax({a}, -1)", "{a}.detach() * {b}",
               "{a}.clone().mul_({b})", "{a} * torch.arange(3, dtype=%s, device={a}.device)" % self.dt(),
               "{a}.t().t() * {b}", "torch.cat(torch.split({a}, [1, 2], -1)[::-1], -1)",
               # gathers of repeated rows: their gradients are zeros and then a scatter-add into them
               "{a}[torch.tensor([1, 1], device={a}.device)] * {b}",
               "{a}.index_select(-1, torch.tensor([2, 0, 2], device={a}.device)) + {b}",
               "torch.einsum('bd->db', {a}).T + torch.einsum('bd,de->be', {b}, {c}.T @ {a})",
               "torch.tanh({a}.t().contiguous().t() * {b})",  # a value over transposed memory, saved
               # ops with several outputs or an extern kernel (saved values of other dtypes/layouts)
               "torch.nn.functional.scaled_dot_product_attention({a}[None, None], {b}[None, None], "
               "{c}[None, None], is_causal=%s)[0, 0]" % r.choice([True, False]),  # 4-d: CPU flash attention
               # a row made non-constant first: layer_norm of a constant row (an expanded leaf) is 0/0,
               # and inductor rounds it differently from eager by up to ~3e-3 (seen without a scan)
               "torch.nn.functional.layer_norm({a} + torch.arange(3, dtype=%s, device={a}.device), (3,)) * {b}"
               % self.dt(), "{a}.max(-1, keepdim=True).values * {b}",
               "{a}.sort(-1).values * {b}", "{a}.cumsum(-1) * 0.3", "torch.logsumexp({a}, -1, keepdim=True) - {b}",
               # reductions over every dim (torch_xla alone reads amax()'s dim=() as no dim)
               "{a} / (1 + {a}.abs().amax())", "{a} * {b}.amin(keepdim=True)", "{a} - {b}.sum(()) * 0.1",
               "torch.nn.functional.normalize({a} + 1.5, dim=-1)", "{a}.var(-1, keepdim=True) + {b}",
               "torch.nn.functional.gelu({a}).clamp(-0.3, 0.4)", "{a}.masked_fill({b} > 0.3, 0.25)",
               "{a}.reshape(3, 2).t() * {b}", "{a}.diagonal().sum() * {b}",
               # a scan in the body: an inner loop over the two rows
               "inner_scan(lambda c, r: (torch.tanh(c * 0.5 + r), c * {b}[0]), {c}[1], {a})[1] + 0.1"]
        if self.ints:
            i = r.choice(self.ints)
            ops += ["{a} * (%s %% 3).to(%s)" % (i, self.dt()), "{a}.gather(1, (%s %% 3).expand(2, 3))" % i]
        if self.bools:
            ops.append("torch.where(%s, {a}, {b})" % r.choice(self.bools))
        return r.choice(ops).format(a=a, b=b, c=c)

    def dt(self):
        return f"torch.{_dt(self.p.dtype)}"

    def closure_op(self, name, shape):
        a = self.pick()
        if len(shape) == 2:
            return self.rng.choice([f"{a} @ {name}", f"{a} @ {name}.t()", f"torch.matmul({a}, {name}) * 0.5"])
        return self.rng.choice([f"{a} * {name}", f"{a} + {name}"])

    def read_inputs(self):
        p = self.p
        for path, leaf in leaf_paths(p.carry, "carry") + leaf_paths(p.xs, "x"):
            self.read_leaf(path, leaf)
        if not self.floats:
            self.new(f"torch.ones(2, 3, dtype={self.dt()}, device=DEVICE)")

    def read_leaf(self, path, leaf):
        if path.startswith("x"):
            self.x_paths.append(path)
        if leaf.kind == "float":
            self.new(TO_BD[leaf.shape].format(path))
        elif leaf.kind == "int":
            self.ints.append(path if leaf.shape == () else f"{path}.unsqueeze(-1)")
        else:
            self.bools.append(path)

    def source(self):
        r, p = self.rng, self.p
        self.read_inputs()
        steps = [("closure", n, s) for n, s, _, u in p.closures for _ in range(u)]
        steps += [("meta", n, s) for n, s, _, u in p.closures if u == 0]
        steps += [("module",)] * (r.choice([1, 2]) if p.module else 0)
        steps += [("op",)] * r.randint(1, 5)
        r.shuffle(steps)
        for step in steps:
            if step[0] == "closure":
                self.new(self.closure_op(step[1], step[2]))
            elif step[0] == "meta":  # the tensor is closed over but only its shape is read
                self.new(f"{self.pick()}.reshape(2, {step[1]}.shape[-1])")
            else:
                self.new(f"lin({self.pick()})" if step[0] == "module" else self.op())
        carry_src = render(p.carry, self.carry_out_factory())
        y_src = "None" if r.random() < 0.1 else render(gen_tree(r, self.y_leaf), lambda e: e)
        params = ", ".join([n for n, *_ in p.closures] + (["lin"] if p.module else []))
        body = "\n".join(["def make_body(%s):" % params, "    def body(carry, x):"]
                         + [f"        {line}" for line in self.lines]
                         + [f"        return {carry_src}, {y_src}", "    return body"])
        return body + "\n"

    def carry_out_factory(self):
        paths = iter(leaf_paths(self.p.carry, "carry"))

        def out(leaf):
            path, _ = next(paths)
            r, a = self.rng, self.pick()
            if r.random() < 0.12:
                return path  # passed through unchanged
            if leaf.kind == "int":
                return r.choice([f"{path} + 1", f"{path} + ({a} > 0.0123).sum()"]
                                + [f"{path} + {i}.sum()" for i in self.ints])
            if leaf.kind == "bool":
                return r.choice([f"{path} | ({a}.sum() > 0.0123)", f"~{path}"])
            return {(B, D): "torch.tanh({})", (D,): "torch.tanh({}).mean(0)", (): "torch.tanh({}).mean()",
                    (B,): "torch.tanh({}).mean(-1)"}[leaf.shape].format(a)
        return out

    def y_leaf(self):
        r, a = self.rng, self.pick()
        choices = [f"{a}", f"{a}.sum(-1)", f"{a}.mean()", f"{a}.mean(0)", f"({a} > 0.0123).sum(-1)",
                   f"({a} + 0.0123 * torch.arange(3, device={a}.device)).argmax(-1)", f"{a}[:, 0] > 0.0123"]
        choices += self.x_paths + [f"{path}" for path, _ in leaf_paths(self.p.carry, "carry")]
        choices += [f"{n}.sum(0) * 2" for n, *_ in self.p.closures]
        return r.choice(choices)


class _WritingBody(_fuzz_writes.WritingBody, _BodyWriter):
    pass


# ------------------------------------------------------------- materialize

@dataclasses.dataclass
class Instance:
    init: object
    xs: object
    closures: list
    module: object
    body: object
    make_body: object
    bases: object  # init, or (with writes) what init's written leaves and carried buffers copy
    buffers: list  # closed-over buffers the body writes into (copies of buffer_bases)
    buffer_bases: list

    def targets(self, inputs=True):
        """What gradients are taken of: float inputs requiring grad, closures, parameters."""
        leaves = tensors((self.bases, self.xs) if inputs else ()) + tensors(self.closures)
        params = list(self.module.parameters()) if self.module is not None else []
        return [t for t in leaves + params + self.buffer_bases if t.requires_grad]

    def body_with(self, closures, buffers=None):
        """A fresh body over these closures and (default: this instance's) buffers."""
        buffers = self.buffers if buffers is None else buffers
        return self.make_body(*closures, *buffers, *([self.module] if self.module is not None else []))

    def observed(self, out, buffers=None):
        """What is compared: the scan's output, and the closed-over buffers after it."""
        buffers = self.buffers if buffers is None else buffers
        return (out, list(buffers)) if buffers else out


def compile_source(p, device=FUZZ_DEVICE):
    filename = f"<fuzz body seed {p.seed}>"
    linecache.cache[filename] = (len(p.source), None, p.source.splitlines(True), filename)
    from torch_scan_hop import scan as inner_scan

    ns = {"torch": torch, "Pair": Pair, "DEVICE": torch.device(device), "inner_scan": inner_scan}
    exec(compile(p.source, filename, "exec"), ns)
    return ns["make_body"]


def materialize(p, device=FUZZ_DEVICE):
    g = torch.Generator().manual_seed(p.seed)

    def tensor(leaf, shape, scale=0.5):
        if leaf.kind == "float":
            t = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(p.dtype)
        else:
            t = torch.randint(0, 5 if leaf.kind == "int" else 2, shape, generator=g)
            t = t.bool() if leaf.kind == "bool" else t
        return t.to(device).requires_grad_(leaf.grad)

    closures = [tensor(Leaf("float", s, rg), s, 1 / math.sqrt(D)) for _, s, rg, _ in p.closures]
    module = None
    if p.module:
        with torch.random.fork_rng():
            torch.manual_seed(p.seed)
            module = eval(p.module, {"torch": torch}).to(p.dtype).to(device)
    init = tmap(lambda l: tensor(l, l.shape), p.carry)
    xs = tmap(lambda l: tensor(l, full_shape(p, l)), p.xs)
    make_body = compile_source(p, device)
    carried = _fuzz_writes.buffer_bases(p, g, device, "carried")
    buffer_bases = _fuzz_writes.buffer_bases(p, g, device, "closed")
    bases = (init, carried) if p.writes and p.writes.carried else init
    buffers = [b.clone() for b in buffer_bases]
    inst = Instance(_fuzz_writes.prepare(p, init, carried), xs, closures, module, None, make_body, bases, buffers,
                    buffer_bases)
    inst.body = inst.body_with(closures)
    return inst


def loop(p, inst):
    """The Python for-loop (and the closed-over buffers after it). For length 0: init and empty
    ys shaped like one body call's."""
    return inst.observed(run_loop(p, inst.body, inst.init, inst.xs, inst.buffers))


def run_loop(p, body, init, xs, buffers=()):
    """``loop`` of another body and inputs (the same problem); ``buffers``: its closed-over ones."""
    device = next((t.device for t in tensors(init)), FUZZ_DEVICE)
    if p.length > 0 and p.writes is not None and p.writes.index:
        return _fuzz_writes.index_loop(p, body, init, xs, device)
    if p.length > 0:
        return reference_scan(body, init, xs, length=p.length, reverse=p.reverse, dim=p.dim)
    x = tmap(lambda l: torch.zeros(l.shape, dtype=l.dtype(p.dtype), device=FUZZ_DEVICE), p.xs)
    with torch.no_grad():
        if p.writes is not None:
            _, y = _fuzz_writes.shape_call(p, body, init, x, buffers, device)
        else:
            _, y = body(init, x)
    return init, tmap(lambda t: t.new_empty((0, *t.shape)), y)


def loss_weights(p, out):
    g = torch.Generator().manual_seed(p.seed + 1)
    return [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
            for t in tensors(out) if t.is_floating_point()]


def grads(targets, out, weights):
    """d(sum of weighted float outputs)/d(targets); zeros where nothing depends on a target."""
    floats = [t for t in tensors(out) if t.is_floating_point()]
    terms = [(t * w.to(t.device)).sum() for t, w in zip(floats, weights) if t.requires_grad]
    if not targets or not terms:
        return [torch.zeros_like(t) for t in targets]
    return list(torch.autograd.grad(sum(terms), targets, allow_unused=True, materialize_grads=True))
