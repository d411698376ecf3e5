"""Eager remat: one replay engine per scan instead of a torch.utils.checkpoint per step.

A per-step ``torch.utils.checkpoint`` costs what the issue measured (1.7-2.1x
the loop for ``recompute_all``, against ~1.33x for one more forward): each
call builds its own frame, hook objects, device and RNG bookkeeping, and
selective checkpointing runs torch's Python caching modes on top. Here ONE
``StepReplay`` serves every step of a scan. ``recompute_all``, ``min_cut`` and
every ``RematPolicy`` without ``offload`` (names, ``dots_saveable``, a user's)
recompute saved values from recipes recorded in the forward (``remat/recipes.py``;
``_recorded_step``) while every function the body calls is known and
deterministic; otherwise, and for ``sqrt``, binomial and offloading policies:

- forward: each step runs on the tape under saved-tensor hooks whose pack
  keeps a small handle (step, k) instead of the tensor; the step's inputs
  are kept (for ``sqrt`` only every k-th carry), and the CPU (and CUDA) RNG
  state only where it changed since the last kept one;
- backward: the first unpack of a step re-runs that step (RNG restored) and
  collects what it saves, in order; each unpack hands out its tensor, and
  the step's values are dropped once all are handed out (or when another step
  is re-run), so at most one step's activations are alive at a time;
- selective policies once recipes stop serving (or with ``offload``) add a dispatch mode (names:
  ``named``): in the forward it keeps the outputs of the ops the policy saves (on
  ``policy.offload``'s device if set), in the re-run it hands those back instead of computing
  them again; the step in which recipes stopped kept no op outputs: its re-run computes them;
- ``sqrt``: only every k-th carry (k = ceil(sqrt(T))) is kept; the first
  step of a block the backward needs re-runs the whole block on the tape from
  its kept carry, each step's saved values handed out as the backward reaches
  them: T/k carries plus one block's activations, for one extra forward.

With ``create_graph=True`` (double backward) a step is re-run on its original
inputs, so the second-order graph reaches the forward's graph.
"""
import contextlib

import torch

from ..core.drain import drain_at_thread_end
from ..core.schedule import sqrt_block
from ..core.trees import ScanError, map_tensors, own_copy, requiring_grad
from . import keep, policies, recipes, revolve, writes
from .policy_ops import OpKeeps
from .selective_replay import Replay, SelectiveReplay, leaves as _leaves, versions_of as _versions


def _detached(value):
    """The step inputs as fresh leaves with their requires_grad flags, so a re-run
    builds a graph of its own and saves what the forward saved."""
    return map_tensors(lambda t: t.detach().requires_grad_(True) if t.requires_grad else t.detach(), value)


class StepReplay(SelectiveReplay):
    """A scan's remat in eager (see the module docstring). ``step(carry, *rest) -> (carry, y)``."""

    def __init__(self, step, policy, length, sqrt=False, min_cut=False, slots=None):
        policy = policies.nothing_saveable if min_cut else policy
        self.step, self.policy = step, policy
        self.selective = policy.save is not policies.nothing_saveable.save
        self.by_ops = self.selective and policy.reads_ops  # else names only: no dispatch mode
        # recompute_all, policies and min_cut recompute from recipes while they can (remat/recipes.py):
        # policies keep what they save (names: ``named``; ops: remat/policy_ops.py), min_cut what its
        # plan says (remat/keep.py)
        by_recipes = policy.offload is None and not sqrt and slots is None
        self.hot = recipes.HotValues(recompute=not min_cut, budget=keep.BUDGET if min_cut else None,
                                     keeps=OpKeeps(policy) if self.by_ops else None) \
            if min_cut or by_recipes else None
        self.unreplayed = set()  # op-level policy: steps recipes stopped in, re-run without handing back
        self.offload = policy.offload
        self.block = sqrt_block(length) if sqrt else 1
        self.slots = slots  # binomial: at most this many carries at once (remat/revolve.py)
        self.carry_flags = []  # binomial: each step's carry leaves' requires_grad
        self.keep_at = None if slots is None else {0, *revolve.descent(0, length, slots - 1)}
        self.rest, self.carries, self.counts, self.kept = [], {}, [], []
        self.carry_versions = {}  # position -> the versions of its kept carry's tensors when kept
        self.kept_flags = {}  # position -> its kept carry's tensors' requires_grad when kept
        self.copy_carries = False  # the body wrote into a kept carry: keep copies from then on
        self.devices = None  # the carry's CUDA device indices (RNG states to keep), found at step 0
        self.rng = []  # (position, cpu state, (devices, device states)) at step 0 and where it changed
        self.cached = {}  # position -> [values of the re-run, how many still to hand out]
        self.decisions = {}
        self.mutable = {}  # aten op -> writes in place (the dispatch path's kept values, ``_mark_written``)
        self.replaying, self.rpos, self.pos, self.n = None, 0, 0, 0
        self.device_of = None
        self._recording = None  # (saved-tensor hooks, recording mode) of steps recipes serve
        self.plain = False  # the body writes into tensors from outside the step: no remat (remat/writes.py)
        self.probed, self.outside = None, None  # the first step's saved values; the outside tensors it read
        if self.hot is not None:
            self.hot.snapshot, self.hot.on_unusable = self._rng_now, self._unrecorded

    # ---------------------------------------------------------------- forward

    def __call__(self, carry, *rest):
        if self.plain:  # the body writes into tensors from outside the step: the loop (remat/writes.py)
            return self.step(carry, *rest)
        pos = len(self.rest)
        self.rest.append(rest)
        if self.slots is not None:
            self.carry_flags.append(tuple(t.requires_grad for t in _leaves(carry, [])))
        if (pos % self.block == 0) if self.keep_at is None else pos in self.keep_at:
            # init, and every carry once the body was seen writing into one, is kept as a copy
            self.carries[pos] = own_copy(carry) if pos == 0 or self.copy_carries else carry
            self.carry_versions[pos] = _versions(self.carries[pos])
            self.kept_flags[pos] = [t.requires_grad for t in _leaves(self.carries[pos], [])]
        if pos == 0:
            self._note_rng(0, carry)
        self.pos, self.n = pos, 0
        self.kept.append([])
        probe = writes.Probe(carry) if pos == 0 else None
        self.probed = [] if pos == 0 else None
        with probe or contextlib.nullcontext():
            out = self._recorded_step(pos, carry, rest) if self.hot is not None and self.hot.usable else \
                self._step_on_hooks(pos, carry, rest)
        if probe is not None:
            probed, self.probed = self.probed, None
            if probe.written:
                self._plain(probe.written)
                return out
            for p in probed:  # remat serves the step: its saved values are the handles
                p.kept = None
            self.outside = probe.versions()
        elif self.outside:
            writes.check(self.outside, pos)
        if pos in self.carry_versions and _versions(self.carries[pos]) != self.carry_versions[pos]:
            self._restore_kept_carry(pos)
        return out

    def _plain(self, written):
        """The first step wrote into a tensor from outside it: that step's saved values are the tensors
        themselves (``writes.Probed``), and later steps run as the loop (remat/writes.py)."""
        writes.fall_back(written)
        self.plain = True
        self.carries, self.carry_versions, self.rest, self.kept = {}, {}, [], []
        self.hot = self._recording = None

    def _restore_kept_carry(self, pos):
        """Step ``pos`` wrote into the carry it was given (the loop allows it where nothing saved
        the value), which is the kept one: it is computed again from the carry kept before it
        (no tape; init is always a copy), and later carries are kept as copies. Keeping copies
        from the start would cost a carry's memory per kept step for the bodies that never write."""
        self.copy_carries = True
        prev = max(p for p in self.carries if p < pos)
        carry = self.carries[prev]
        with torch.no_grad(), (self.rng_at(prev) if len(self.rng) > 1 else contextlib.nullcontext()):
            for p in range(prev, pos):
                carry = self.step(own_copy(carry), *self.rest[p])[0]
        # the flags the step began with: a write by a value requiring grad (c.mul_(w)) made one require grad
        self.carries[pos] = requiring_grad(carry, self.kept_flags[pos])
        self.carry_versions[pos] = _versions(self.carries[pos])

    def _step_on_hooks(self, pos, carry, rest):
        out = None
        if self.hot is not None:
            self.hot.start_step()
        try:
            with self._hooks(self._pack, self._unpack):
                out = self.step(carry, *rest)
        finally:
            if self.hot is not None:
                self.hot.end_step(_leaves(out[0], []) if out is not None else ())
        self.counts.append(self.n)
        self._note_rng(pos + 1, carry)  # the state the next step starts from
        return out

    def _recorded_step(self, pos, carry, rest):
        """A step whose saved values recipes serve (remat/recipes.py): the hooks and the recording mode
        built once per scan, ``checkpoint_name`` answered by this engine (the identity: under the mode
        its own checks would each be a recorded call). No RNG state is noted: a step served by
        recipes is never re-run, and the first function that is not recorded notes it for its step
        before it runs (``_unrecorded``)."""
        hot, namers = self.hot, policies.namers()
        if self._recording is None:
            self._recording = (torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
                               recipes.Forward(hot))
        hooks, mode = self._recording
        hot.start_step()
        out = None
        namers.append(self)
        try:
            with hooks, mode:
                out = self.step(carry, *rest)
        finally:
            namers.pop()
            hot.end_step(_leaves(out[0], []) if out is not None else ())
        self.counts.append(self.n)
        if not hot.usable:  # the step's rest is re-run in the backward: the next one may be too
            self._note_rng(pos + 1, carry)
        return out

    def _unrecorded(self, now):
        """Recipes stop serving in the middle of step ``pos``: it will be re-run from the RNG state it
        started from, ``now`` (taken before the function that stopped them ran; the recorded,
        deterministic, functions before it drew nothing). An op-level policy kept no op outputs in
        that step for a re-run to take: it re-runs the step computing them."""
        self._note_rng(self.pos, (), now)
        self.unreplayed.add(self.pos)

    @contextlib.contextmanager
    def _hooks(self, pack, unpack):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            if self.hot is not None and self.hot.usable:
                with recipes.Forward(self.hot):
                    yield
                return
            if not self.selective:
                yield
                return
            with (Replay(self) if self.by_ops else contextlib.nullcontext()), policies.naming(self):
                yield

    def _pack(self, t):
        k = self.n
        self.n += 1
        if self.hot is not None and self.hot.usable:  # kept as it is, or a recipe (remat/recipes.py)
            handle = self.hot.pack(t) or recipes.Kept(t)
        else:
            handle = self.pos, k
        if self.probed is not None:  # the first step: its saved values held until it ends (remat/writes.py)
            handle = writes.Probed(handle, t)
            self.probed.append(handle)
        return handle

    def _rng_now(self):
        """The CPU RNG state and that of the carry's CUDA devices (found at step 0)."""
        devices = self.devices
        return torch.get_rng_state(), (devices, [torch.cuda.get_rng_state(d) for d in devices])

    def _note_rng(self, pos, carry, now=None):
        if self.devices is None:
            # device indices, not the tensors: the step-0 carry stays free to go
            self.devices = sorted({t.get_device() for t in _leaves(carry, []) if t.device.type == "cuda"})
        state, device_states = now or self._rng_now()
        if self.rng:
            _, last, (_, last_dev) = self.rng[-1]
            if torch.equal(last, state) and all(torch.equal(a, b) for a, b in zip(last_dev, device_states[1])):
                return
        self.rng.append((pos, state, device_states))

    # ---------------------------------------------------------------- backward

    def _unpack(self, handle):
        drain_at_thread_end()  # the backward may run in a thread the forward did not: core/drain.py
        if isinstance(handle, writes.Probed):
            if handle.kept is not None:  # a plain step's (remat/writes.py)
                return handle.kept.get()
            handle = handle.handle
        if isinstance(handle, recipes.Kept):
            return handle.get()
        if isinstance(handle, recipes.Handle):
            return self.hot.value(handle)
        pos, k = handle
        cached = self.cached.get(pos)
        if cached is None:
            self._rerun_for(pos)
            cached = self.cached[pos]
        value = cached[0][k]
        cached[1] -= 1
        if cached[1] == 0:
            del self.cached[pos]
        return value

    def _rerun_for(self, pos):
        """Re-run what the backward needs for step ``pos``: that step (``sqrt``: its whole
        block, from the block's kept carry, each step's saved values kept until handed out)."""
        if self.slots is not None:
            carry = revolve.advance(self, pos)
            self.cached = {pos: [self._rerun(pos, carry)[0], self.counts[pos]]}
            return
        start = pos - pos % self.block
        carry, self.cached = self.kept_carry(start), {}
        for p in range(start, min(start + self.block, len(self.rest))):
            values, carry = self._rerun(p, carry)
            self.cached[p] = [values, self.counts[p]]
            if p == pos and self.block == 1:
                break

    def kept_carry(self, pos):
        """The carry step ``pos`` began with, as kept. A body that writes into its carry in place
        changed it after it was kept (the loop allows the write where nothing saved the value):
        a re-run from it would compute other values than the forward did, so this says so."""
        carry = self.carries[pos]
        if pos in self.carry_versions and _versions(carry) != self.carry_versions[pos]:
            raise ScanError(f"scan: remat: the body modified its carry in place at step {pos} (an in-place op such "
                            "as mul_ or copy_ on the carry it was given); the backward re-runs steps from the "
                            "carry they began with, which the write changed. Write the op out of place "
                            "(c = c * 0.5 for c.mul_(0.5)), or use remat='save_all'.")
        return carry

    def run_step(self, pos, carry):
        if not self.selective:
            return self.step(carry, *self.rest[pos])
        self.replaying, self.rpos = (self.kept[pos] if self.selective else None), 0
        try:
            with (Replay(self) if self.by_ops and pos not in self.unreplayed else contextlib.nullcontext()), \
                    (policies.naming(self) if self.selective else contextlib.nullcontext()):
                return self.step(carry, *self.rest[pos])
        finally:
            self.replaying = None

    @contextlib.contextmanager
    def rng_at(self, pos):  # (with one state kept no step drew a random number: nothing to restore)
        entry = None
        for e in self.rng:
            if e[0] > pos:
                break
            entry = e
        _, state, (devices, device_states) = entry
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(state)
            if devices:
                torch.utils.checkpoint.set_device_states(devices, device_states)
            yield

    def _rerun(self, pos, carry):
        """Step ``pos`` again on the tape: (what it saves, in order; its new carry)."""
        rest = self.rest[pos]
        detach = not torch.is_grad_enabled()  # a plain backward: the re-run builds a graph of its own
        if detach:
            carry, self.rest[pos] = _detached((carry, rest))
        values = []

        def pack(t):  # detached: the re-run's graph must not live on through what it saved
            values.append(t.detach() if detach else t)
            return len(values) - 1

        try:
            with torch.enable_grad(), (self.rng_at(pos) if len(self.rng) > 1 else contextlib.nullcontext()), \
                    torch.autograd.graph.saved_tensors_hooks(pack, values.__getitem__):
                new_carry = self.run_step(pos, own_copy(carry))[0]
        finally:
            self.rest[pos] = rest
        if len(values) != self.counts[pos]:
            raise ScanError(f"scan: remat: step {pos} saved {len(values)} tensors for the backward when re-run, "
                            f"{self.counts[pos]} in the forward; the body must run the same ops when it is "
                            "re-run (use remat='save_all' for a body that does not).")
        return values, new_carry
