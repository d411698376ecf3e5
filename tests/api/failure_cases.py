"""Failure injections run in a child interpreter by test_failures.py (one child per route).

``main(route)`` makes the body raise in its forward or backward (a custom autograd.Function),
under anomaly mode's NaN check, with an Exception, a KeyboardInterrupt or a BaseException of
its own, along each route; every case must raise, and the next correct call in the same
process must give the loop's values and gradients. A line per case that does not, then
``end``; the child then exits after a failed backward, which must not crash the interpreter.
"""
import functools
import sys

import torch
from conftest import reference_scan

import torch_scan_hop as tsh
from torch_scan_hop import checkpoint_name, scan, scan_layers

T = 5
INJECT = {"traced": False, "fwd": None, "bwd": None, "nan": None, "exc": ValueError, "nf": 0, "nb": 0}


class Injected(BaseException):
    """A BaseException of the user's own (not an Exception): must pass through as it is."""


class Probe(torch.autograd.Function):
    """The identity, whose backward raises (or returns NaN) at its ``INJECT["bwd"]``-th call."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        if INJECT["traced"]:  # traced once: no counter (Dynamo refuses the mutation)
            if INJECT["bwd"] is not None:
                raise ValueError("injected in the backward")
            return g * float("nan") if INJECT["nan"] is not None else g
        n, INJECT["nb"] = INJECT["nb"], INJECT["nb"] + 1
        if INJECT["bwd"] == n:
            raise INJECT["exc"]("injected in the backward")
        return g * float("nan") if INJECT["nan"] == n else g


def _fires_in_forward():
    if INJECT["traced"]:
        return INJECT["fwd"] is not None
    n, INJECT["nf"] = INJECT["nf"], INJECT["nf"] + 1
    return INJECT["fwd"] == n


def problem(device="cpu"):
    g = torch.Generator().manual_seed(0)
    w, init, xs = (torch.randn(*s, dtype=torch.float64, generator=g).to(device).requires_grad_()
                   for s in ((4, 4), (3, 4), (T, 3, 4)))

    def body(c, x):
        if _fires_in_forward():
            raise INJECT["exc"]("injected in the forward")
        h = checkpoint_name(torch.sin(Probe.apply(torch.tanh(c @ w + x))) * 2, "a")
        return h, (h * h).sum(-1)

    return body, (init, xs), [init, xs, w]


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, h):
        if _fires_in_forward():
            raise INJECT["exc"]("injected in the forward")
        return Probe.apply(torch.tanh(self.lin(h)))


def layers_problem(remat):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Layer() for _ in range(T)])
    h = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def loop(h):
        for m in layers:
            h = m(h)
        return h, h.sum(-1)
    def run(h):
        out = scan_layers(layers, h, remat=remat)
        return out, out.sum(-1)
    return (lambda _, h: loop(h)), (lambda _, h: run(h)), (None, h), [h, *layers.parameters()]


INJECTIONS = {
    "forward at step 0": dict(fwd=0), "forward mid": dict(fwd=T // 2), "forward last": dict(fwd=T - 1),
    "forward in a re-run": dict(fwd=T), "backward at step 0": dict(bwd=0), "backward mid": dict(bwd=T // 2),
    "backward last": dict(bwd=T - 1), "assert in the backward": dict(bwd=1, exc=AssertionError),
    "KeyboardInterrupt in the forward": dict(fwd=1, exc=KeyboardInterrupt),
    "KeyboardInterrupt in the backward": dict(bwd=1, exc=KeyboardInterrupt),
    "BaseException in the backward": dict(bwd=1, exc=Injected), "NaN under anomaly mode": dict(nan=1, anomaly=True),
    "NaN at step 0 under anomaly mode": dict(nan=0, anomaly=True),
}
TRACED = ("forward at step 0", "backward at step 0", "NaN under anomaly mode")


def _loss_and_grads(run, args, inputs):
    carry, ys = run(*args)
    loss = carry.sum() + ys.sum()
    return [loss.detach(), *torch.autograd.grad(loss, inputs)]


def _set(**kw):
    INJECT.update({"fwd": None, "bwd": None, "nan": None, "exc": ValueError, "nf": 0, "nb": 0, **kw})


def check(name, loop, run, args, inputs, injections, failures):
    """Each injection on ``run``, then a correct call against ``loop``; a line per failure."""
    want = _loss_and_grads(loop, args, inputs)
    for inj in injections:
        kw = dict(INJECTIONS[inj])
        anomaly = kw.pop("anomaly", False)
        _set(**kw)
        try:
            with torch.autograd.set_detect_anomaly(anomaly):
                _loss_and_grads(run, args, inputs)
            raised = False
        except BaseException:  # noqa: BLE001  (KeyboardInterrupt and the user's own included)
            raised = True
        _set()
        may_not_raise = inj == "forward in a re-run" or (INJECT["traced"] and inj != "forward at step 0")
        if not raised and not may_not_raise:
            failures.append(f"{name}, {inj}: nothing raised")
        try:
            got = _loss_and_grads(run, args, inputs)
            if not all(torch.allclose(a.cpu(), b.cpu()) for a, b in zip(got, want)):
                failures.append(f"{name}, {inj}: the next call differs from the loop")
        except BaseException as e:  # noqa: BLE001
            failures.append(f"{name}, {inj}: the next call raised {type(e).__name__}: {e}")


def _policies():
    return {"save_all": "save_all", "recompute_all": "recompute_all", "min_cut": "min_cut",
            "dots_saveable": tsh.dots_saveable, "names": tsh.save_only_these_names("a"), "sqrt": "sqrt",
            "binomial": ("binomial", 2), "offload": tsh.dots_saveable.with_offload("cpu")}


def eager(failures):
    injections = list(INJECTIONS)
    for name, policy in _policies().items():
        body, args, inputs = problem()
        check(f"eager {name}", lambda *a: reference_scan(body, *a), lambda *a: scan(body, *a, remat=policy), args,
              inputs, injections, failures)
    for name, kw in (("reverse sqrt", dict(reverse=True, remat="sqrt")),
                     ("unroll 2 recompute_all", dict(unroll=2, remat="recompute_all"))):
        body, args, inputs = problem()
        check(name, lambda *a: reference_scan(body, *a, reverse=kw.get("reverse", False)),
              lambda *a: scan(body, *a, **kw), args, inputs, ["backward mid", "KeyboardInterrupt in the backward"],
              failures)
    for remat in ("save_all", "recompute_all"):
        loop, run, args, inputs = layers_problem(remat)
        check(f"scan_layers {remat}", loop, run, args, inputs, ["forward mid", "backward mid"], failures)


def compiled(failures):
    from torch.fx.experimental.proxy_tensor import make_fx

    body, args, inputs = problem()
    check("make_fx", lambda *a: reference_scan(body, *a), lambda *a: make_fx(lambda *b: scan(body, *b))(*a)(*a),
          args, inputs, ["forward at step 0", "backward at step 0"], failures)
    INJECT["traced"] = True
    compiled_scan = torch.compile(lambda *a: scan(body, *a), backend="aot_eager", fullgraph=True)
    check("aot_eager", lambda *a: reference_scan(body, *a), compiled_scan, args, inputs, TRACED, failures)
    INJECT["traced"] = False


def xla(failures):
    import torch_xla.core.xla_model as xm

    for remat in ("save_all", "recompute_all"):
        body, args, inputs = problem(xm.xla_device())
        check(f"xla {remat}", lambda *a: reference_scan(body, *a), lambda *a: scan(body, *a, remat=remat), args,
              inputs, ["forward at step 0", "backward at step 0", "NaN at step 0 under anomaly mode"], failures)


def end_on_a_failed_backward():
    """Leave the process right after a backward that raised (what crashed torch 2.15 at exit)."""
    for policy in ("names", "recompute_all"):
        body, args, inputs = problem()
        _set(bwd=T // 2)
        try:
            _loss_and_grads(lambda *a: scan(body, *a, remat=policy), args, inputs)
        except ValueError:
            pass


class Raises(torch.autograd.Function):
    """The identity, whose backward always raises (a thread's own injection: INJECT is shared)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        raise ValueError("injected in a thread's backward")


def _failing_problem():
    """problem()'s body, raising in the backward of step T // 2 while ``fail[0]``."""
    body, (init, xs), inputs = problem()  # INJECT left at rest: its body is safe to share between threads
    fail = [True]

    def failing(c, x_and_i):
        c, y = body(c, x_and_i[0])
        return (Raises.apply(c) if fail[0] and int(x_and_i[1]) == T // 2 else c), y
    return failing, fail, (init, (xs, torch.arange(T))), inputs


def fail_then_match(name, policy, failures):
    """In this thread: a backward that raises, then a correct call against the loop."""
    from _exit_race import hold_thread_end

    failing, fail, args, inputs = _failing_problem()
    try:
        _loss_and_grads(lambda *a: scan(failing, *a, remat=policy), args, inputs)
        failures.append(f"{name}: nothing raised")
    except ValueError:
        pass
    hold_thread_end()
    fail[0] = False
    got, want = (_loss_and_grads(f, args, inputs) for f in (lambda *a: scan(failing, *a, remat=policy),
                                                              lambda *a: reference_scan(failing, *a)))
    if not all(torch.allclose(a, b) for a, b in zip(got, want)):
        failures.append(f"{name}: the next call differs from the loop")


def _backward_from_threads(policy, n, failures):
    """One forward here; its backward from n threads at once (torch's multithreaded backward).
    Covered where the failure comes after the backward reached our unpack hook in that thread
    (here: steps T-1 .. T//2+1 unpacked first); see core/drain.py for the case it does not."""
    from _exit_race import hold_thread_end

    failing, _, args, inputs = _failing_problem()
    carry, ys = scan(failing, *args, remat=policy)
    loss = carry.sum() + ys.sum()

    def backward():
        try:
            torch.autograd.grad(loss, inputs, retain_graph=True)
            failures.append(f"backward from threads {policy}: nothing raised")
        except ValueError:
            pass
        hold_thread_end()
    _run_threads([backward] * n)


def _run_threads(fns):
    import threading

    ts = [threading.Thread(target=f) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


_POOL = []  # alive until exit: its workers end in threading's exit hook, just before the interpreter finalizes


def threads(failures):
    """Backwards that fail in threads other than the main one; every thread here ends at exit's
    doorstep (tests/api/_exit_race.py), where their stranded autograd tasks aborted the process."""
    import concurrent.futures

    for policy in ("save_all", "recompute_all", "names"):
        _run_threads([functools.partial(fail_then_match, f"a thread {policy}", _policies()[policy], failures)])
    _run_threads([functools.partial(fail_then_match, f"threads at once {p}", _policies()[p], failures)
                  for p in ("save_all", "recompute_all", "sqrt", "min_cut")])
    _POOL.append(concurrent.futures.ThreadPoolExecutor(2))
    for policy in ("recompute_all", "dots_saveable"):
        _POOL[0].submit(fail_then_match, f"a pool {policy}", _policies()[policy], failures).result()
    _backward_from_threads("recompute_all", 3, failures)
    _backward_from_threads("sqrt", 2, failures)
    _alive_at_exit(failures)


def inference_threads(failures):
    """Threads that run scans forward only (no backward of their own) and end at exit's doorstep. Each
    armed the drain (core/drain.py), whose small backward at the thread's end once went through
    torch's Python wrapper: on torch 2.12 that left a Python object in a C++ thread_local, freed
    after the hold (its thread_local is made first here, so freed after it): SIGABRT at exit."""
    from _exit_race import hold_thread_end

    def work(grad):
        torch._C._is_key_in_tls("context")  # makes the thread_local (empty) before the hold
        hold_thread_end()
        body, args, _ = problem()
        with torch.set_grad_enabled(grad):
            got, want = scan(body, *args), reference_scan(body, *args)
        if not all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(got),
                                                    torch.utils._pytree.tree_leaves(want))):
            failures.append(f"inference thread (grad {grad}): differs from the loop")

    _run_threads([functools.partial(work, False), functools.partial(work, True)])


def _alive_at_exit(failures):
    """A daemon thread that trained through scans and is still running at exit: the finalizing
    interpreter clears its Python state (as it does the engine's CUDA threads', where the
    backward's hooks run), and the drain armed there ran a backward then: SIGABRT
    (THPVariable_clear's assert, torch 2.11 and 2.15)."""
    import threading

    ready = threading.Event()

    def train():
        for policy in ("save_all", "recompute_all", "sqrt", "min_cut"):
            try:
                body, args, inputs = problem()
                got = _loss_and_grads(lambda *a, p=policy: scan(body, *a, remat=_policies()[p]), args, inputs)
                want = _loss_and_grads(lambda *a: reference_scan(body, *a), args, inputs)
                if not all(torch.allclose(a, b) for a, b in zip(got, want)):
                    failures.append(f"alive at exit {policy}: differs from the loop")
            except Exception as e:  # noqa: BLE001
                failures.append(f"alive at exit {policy}: {type(e).__name__}: {e}")
        ready.set()
        threading.Event().wait()  # never set: alive at exit

    threading.Thread(target=train, daemon=True).start()
    ready.wait()


def main(route):
    failures = []
    {"eager": eager, "compiled": compiled, "xla": xla, "threads": threads,
     "inference_threads": inference_threads}[route](failures)
    print("\n".join(failures))
    print("end")
    sys.stdout.flush()
    end_on_a_failed_backward()
