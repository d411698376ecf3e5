"""In-place writes for the differential fuzzer (issue 63 item 5): what ``_fuzz.generate`` adds to
about a quarter of its problems, and the loop they are checked against.

A problem with ``Writes`` may
- write a float carry leaf in place at the top of the body (``carry['h'].mul_(0.5).add_(...)``,
  ``.mul_(torch.sigmoid(...))``, ``.copy_(...)``), and return either a new value or the written
  tensor itself as the new carry;
- carry buffers (``state = (carry, bufs)``, each ``(ROWS, B, D)`` or ``(B, ROWS, D)``) and
- close over buffers (``K0, K1``: the caller's tensors, compared after the scan too),
both written at the step index ``t`` (``with_index=True``: ``buf[t] = row``, ``index_copy_``,
``buf[t] = buf[t] + row``) and read at it and at the row the previous step wrote (``(t - 1) % ROWS``,
``(t + 1) % ROWS`` under reverse), so gradients flow from rows written at one step into later steps.

The decision and every choice are drawn from their own generator (``random.Random`` of the seed
and "writes"), after the problem's own draws: a seed without writes draws what it always did.

Written values are never the ones autograd saved: the loop itself would then fail its backward
(reads of buffers are copies, ``buf[i].clone()``, or ops that save nothing of their input; a
written carry leaf's new value is not an output that its op saves, ``torch.tanh(a) * 0.9``; a carry
written and returned itself is read through ``.clone()``). A written carry leaf or buffer that
requires grad is a copy (``clone``) of its base, the tensor gradients are taken of: the loop
writes into the tensors it is handed, and a leaf that requires grad cannot be written.
"""
import dataclasses
import random

import torch
import torch.utils._pytree as pytree

ROWS = 12  # a buffer's rows: the longest scan any mode runs (length 9, +3 at a dynamic recompile)
SHARE = 0.27  # of the problems that write
TO_SHAPE = {(2, 3): "{}", (3,): "{}.mean(0)", (): "{}.mean()", (2,): "{}.mean(-1)"}
CARRY_OPS = ["{c}.mul_(0.5).add_({o})", "{c}.mul_(torch.sigmoid({o}))", "{c}.copy_(torch.tanh({c} * 0.5 + {o}))",
             "{c}.add_({o}, alpha=0.3).mul_(0.9)", "{c}.mul_(0.8)"]


@dataclasses.dataclass(frozen=True)
class Writes:
    index: bool  # with_index=True: the body is body(carry, x, t)
    carry_ops: tuple  # (leaf index in leaf_paths(carry), passed through: returned itself)
    carried: tuple  # per carried buffer: (axis of the rows, requires_grad)
    closed: tuple  # per closed-over buffer: (axis, requires_grad)

    def describe(self):
        return (f"  writes: with_index={self.index}, carry leaves written {list(self.carry_ops)} "
                f"(index, returned itself), carried buffers {list(self.carried)}, closed-over "
                f"buffers {list(self.closed)} (axis, requires_grad); {ROWS} rows")


# seeds that test_differential.REGRESSIONS replayed before problems wrote in place: they draw as
# they did then (a write would change the problem they reproduce)
UNWRITTEN = frozenset({13002, 30001})


def draw(seed, carry_leaves):
    """``Writes`` for about SHARE of the seeds, else None. ``carry_leaves``: [(path, Leaf)]."""
    r = random.Random(f"writes {seed}")
    if r.random() >= SHARE or seed in UNWRITTEN:
        return None
    floats = [i for i, (_, leaf) in enumerate(carry_leaves) if leaf.kind == "float"]
    ops = tuple((i, r.random() < 0.3) for i in floats if r.random() < 0.5)
    bufs = lambda n: tuple((r.choice([0, 0, 1]), r.random() < 0.6) for _ in range(n))  # noqa: E731
    carried, closed = bufs(r.choice([0, 0, 1, 1, 2])), bufs(r.choice([0, 0, 1, 1, 2]))
    if not (ops or carried or closed):
        carried = bufs(1)
    return Writes(bool(carried or closed) or r.random() < 0.5, ops, carried, closed)


def rng(seed):
    return random.Random(f"writes body {seed}")


def buffer_shape(axis):
    return (ROWS, 2, 3) if axis == 0 else (2, ROWS, 3)


# ------------------------------------------------------------------ the body

class WritingBody:
    """Mixed into ``_fuzz._BodyWriter``: the body of a problem with writes."""

    def written(self):
        from _fuzz import leaf_paths
        paths = leaf_paths(self.p.carry, "carry")
        return {paths[i][0]: through for i, through in self.p.writes.carry_ops}

    def buffers(self):
        w = self.p.writes
        return ([(f"bufs[{k}]", axis) for k, (axis, _) in enumerate(w.carried)]
                + [(f"K{k}", axis) for k, (axis, _) in enumerate(w.closed)])

    def carry_writes(self):
        """The top of the body: each written carry leaf written in place, from the other inputs."""
        from _fuzz import TO_BD, leaf_paths
        w, wr = self.p.writes, self.wr
        leaves = leaf_paths(self.p.carry, "carry") + leaf_paths(self.p.xs, "x")
        for i, _ in w.carry_ops:
            path, leaf = leaves[i]
            sources = [(p, l) for p, l in leaves if l.kind == "float" and p != path]
            if sources:
                src = wr.choice(sources)
                o = TO_SHAPE[leaf.shape].format(TO_BD[src[1].shape].format(src[0]))
            else:
                o = "t.to(%s) * 0.1" % self.dt() if w.index else "0.25"
            op = wr.choice(CARRY_OPS)
            if o == "0.25" and "sigmoid" in op:  # torch.sigmoid takes no float (seed 24045)
                o = f"{path}.new_tensor(0.25)"
            self.lines.append(op.format(c=path, o=o))

    def read_inputs(self):
        self.carry_writes()
        self._written = self.written()
        super().read_inputs()

    def read_leaf(self, path, leaf):
        if self._written.get(path):  # returned itself, written again next step: read a copy
            from _fuzz import TO_BD
            self.new(TO_BD[leaf.shape].format(f"{path}.clone()"))
        else:
            super().read_leaf(path, leaf)

    def buffer_steps(self):
        wr, steps = self.wr, []
        for buf, axis in self.buffers():
            steps += [("write", buf, axis)] * wr.choice([1, 1, 2]) + [("read", buf, axis)] * wr.choice([1, 2, 3])
        return steps

    def buffer_step(self, kind, buf, axis):
        wr, row = self.wr, self.pick()
        at = "[t]" if axis == 0 else "[:, t]"
        if kind == "write":
            self.lines.append(wr.choice([f"{buf}{at} = {row}", f"{buf}{at} = {buf}{at} + {row}",
                                         f"{buf}.index_copy_({axis}, t.reshape(1), {row}.unsqueeze({axis}))"]))
            return
        i = wr.choice(["t", f"(t + 1) % {ROWS}" if self.p.reverse else f"(t - 1) % {ROWS}"])
        at = f"[{i}]" if axis == 0 else f"[:, {i}]"
        self.new(wr.choice([f"{buf}{at}.clone()", f"{buf}.select({axis}, {i}) * 1.5",
                            f"{buf}.index_select({axis}, ({i}).reshape(1)).squeeze({axis})",
                            f"{buf}.sum({axis}) * 0.1"]))

    def source(self):
        r, p, w = self.rng, self.p, self.p.writes
        self.read_inputs()
        steps = [("closure", n, s) for n, s, _, u in p.closures for _ in range(u)]
        steps += [("meta", n, s) for n, s, _, u in p.closures if u == 0]
        steps += [("module",)] * (r.choice([1, 2]) if p.module else 0)
        steps += [("op",)] * r.randint(1, 5) + self.buffer_steps()
        r.shuffle(steps)
        for step in steps:
            if step[0] in ("write", "read"):
                self.buffer_step(*step)
            elif step[0] == "closure":
                self.new(self.closure_op(step[1], step[2]))
            elif step[0] == "meta":
                self.new(f"{self.pick()}.reshape(2, {step[1]}.shape[-1])")
            else:
                self.new(f"lin({self.pick()})" if step[0] == "module" else self.op())
        carry_src = render_carry(self)
        y_src = "None" if r.random() < 0.1 else self.render_y()
        params = ", ".join([n for n, *_ in p.closures] + [f"K{k}" for k in range(len(w.closed))]
                           + (["lin"] if p.module else []))
        head = ["def make_body(%s):" % params,
                "    def body(%s, x%s):" % ("state" if w.carried else "carry", ", t" if w.index else "")]
        if w.carried:
            head.append("        carry, bufs = state")
            carry_src = f"({carry_src}, bufs)"
        return "\n".join(head + [f"        {line}" for line in self.lines]
                         + [f"        return {carry_src}, {y_src}", "    return body"]) + "\n"

    def render_y(self):
        from _fuzz import gen_tree, render
        written = self.written()

        def leaf():
            y = self.y_leaf()
            return f"{y} * 1.0" if written.get(y) else y  # a y is never the tensor the next step writes
        return render(gen_tree(self.rng, leaf), lambda e: e)


def render_carry(writer):
    """The new carry's source: a written leaf's new value is no output that its op saves."""
    from _fuzz import leaf_paths, render
    written, plain = writer.written(), writer.carry_out_factory()
    paths = iter(leaf_paths(writer.p.carry, "carry"))

    def out(leaf):
        path, _ = next(paths)
        src = plain(leaf)
        if path not in written:
            return src
        if written[path]:
            return path  # the written tensor itself
        return f"torch.tanh({writer.pick()}) * 0.9" if leaf.shape == (2, 3) else \
            (src if src.startswith("torch.tanh") else TO_SHAPE[leaf.shape].format(f"torch.tanh({writer.pick()})"))
    return render(writer.p.carry, out)


# --------------------------------------------------------- inputs and loop

def prepare(p, init_bases, carried_bases):
    """What the scan is handed: written carry leaves as copies of their bases, the carried buffers."""
    if p.writes is None:
        return init_bases
    leaves, spec = pytree.tree_flatten(init_bases)
    slots = [k for k, t in enumerate(leaves) if t is not None]  # carry_ops index leaf_paths, which skip None
    for i, _ in p.writes.carry_ops:
        leaves[slots[i]] = leaves[slots[i]].clone()
    init = pytree.tree_unflatten(leaves, spec)
    return (init, [b.clone() for b in carried_bases]) if p.writes.carried else init


def from_bases(p, bases):
    """``prepare`` of an Instance's ``bases`` (init's structure, or (init, carried buffers))."""
    if p.writes is None:
        return bases
    return prepare(p, *bases) if p.writes.carried else prepare(p, bases, [])


def buffer_bases(p, g, device, which):
    """The carried or closed-over buffers' bases, drawn from ``g`` after everything else."""
    out = []
    for axis, grad in (getattr(p.writes, which) if p.writes else ()):
        t = (torch.randn(buffer_shape(axis), generator=g, dtype=torch.float64) * 0.5).to(p.dtype)
        out.append(t.to(device).requires_grad_(grad))
    return out


def index_loop(p, body, init, xs, device):
    """The Python for-loop passing t, a 0-d int64 tensor: the index of the x slice (as scan's)."""
    leaves, spec = pytree.tree_flatten(xs)
    carry, ys = init, [None] * p.length
    for i in (reversed(range(p.length)) if p.reverse else range(p.length)):
        x = None if xs is None else pytree.tree_unflatten([None if t is None else t.select(p.dim, i) for t in leaves],
                                                          spec)
        carry, ys[i] = body(carry, x, torch.tensor(i, device=device))
    y_leaves = [pytree.tree_flatten(y)[0] for y in ys]
    stacked = [None if col[0] is None else torch.stack(col) for col in zip(*y_leaves)]
    return carry, pytree.tree_unflatten(stacked, pytree.tree_flatten(ys[0])[1])


def shape_call(p, body, init, x, buffers, device):
    """At length 0: one body call for the ys' shapes that writes into nothing the caller sees."""
    saved = [b.clone() for b in buffers]  # (under no_grad) with a jvp's tangent, restored by copy_
    init = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, init)
    try:
        return body(init, x, torch.tensor(0, device=device)) if p.writes.index else body(init, x)
    finally:
        for b, s in zip(buffers, saved):
            b.copy_(s)
