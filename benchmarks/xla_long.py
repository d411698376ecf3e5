"""Steady time per step on XLA (CPU) at long lengths: is a step's cost flat in T?

Body: c = tanh(c @ W + x), H=16, batch 4 (small, so the step is cheap and any
cost that grows with T shows). Rows: forward with ys (y = c.sum(-1), stacked),
forward without ys, a training step without ys (grads of W and xs: the forward
stacks residuals, the backward stacks the xs grads) and one with ys. Each T gets
the best of a few steady calls (same W and xs, as in a training loop) and the
ratio of its per-step time to T=1k's. Target: every ratio <= 1.2x up to T=100k.

Times are the process's CPU time (all its threads: the work is single-threaded,
so on a quiet box it is the wall time; on a shared one it leaves out the waits
for a core, which made wall-time runs 2x noisy here).
One thread: torch.set_num_threads(1) and XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
(set here unless XLA_FLAGS is set; XLA drops a whole XLA_FLAGS value with a
bare token in it, e.g. "intra_op_parallelism_threads=1").
The second table is the same question for a layer stack: scan_layers' steady
training step (grads of every parameter) against the Python loop over the
layers, Linear(256, 256) + GELU on 1024 rows, 8 / 32 / 64 deep, per layer;
rounds interleave the loop, scan_layers as called by default (one While at every
depth; target: <= 1.0x the loop at every depth), with unroll=1 (the same While) and
with unroll=depth (the straight-line form, no While: csrc/hlo_straight.h; only on request).
``--one-core`` pins the process to one core and times the wall clock instead: on two
cores XLA still runs its parallel fusions on a second thread (the flag above only stops
Eigen's), whose spinning CPU time process_time counts and which a wall clock credits
to whichever form has more independent work; on one core both forms get one thread.
``--stacked`` adds a column for ``stack_layers(layers, grads="stacked")`` (the stacks are the trained
parameters: no stack per call, one gradient per stack).
``--no-shift`` adds a column for the default scan with the shifted carries off (``trace/shift.py``: the backward
reads each layer's input from a stack of its own instead of rebuilding it from the previous layer's saved values),
and its per-round ratio to the default's.
``--keep-ys`` adds a column for the default scan with its stacked ys buffers kept between steps
(``xla/kept_ys.py``, ``SCAN_XLA_KEEP_YS=1``: no fill, no fresh pages per step), and its per-round ratio to the default's.
``--txla`` adds a column for torch_xla's own ``torch_xla.experimental.scan_layers.scan_layers`` (``is_layer_pure=True``:
its traced layer cached between calls) over the same modules, in the same rounds (a cell "failed: ..." if it cannot run).
``--jax`` adds a table for the same stack in JAX (``_xla_long_jax.py``, a process of its own: JAX brings an XLA of its
own; same XLA_FLAGS, CPU mask and clock): ``jax.jit(value_and_grad)`` of the mean square w.r.t. the weights, biases and
input, ``lax.scan`` over stacked parameters (and over per-layer ones stacked in the step, as our default does) against
the layers unrolled in one jit, in interleaved rounds: what JAX's scan costs against JAX's loop, to judge ours by.
``--thunks`` then prints, per depth, the loop's and the default scan's (and the kept-ys column's) device time per step by XLA
thunk kind (``_xla_thunks.py``: the dots, each fusion, the fills; inside the While by its name).
Run: python benchmarks/xla_long.py [--max-len N] [--modes fwd_ys,train] [--depths 8,32,64 | --depths 0] [--one-core] [--stacked] [--no-shift] [--keep-ys] [--thunks] [--txla] [--jax]
"""
import argparse
import copy
import os
import sys
import time
import unittest.mock

if "--one-core" in sys.argv:  # before torch and torch_xla start their threads: they inherit the mask
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
import torch  # noqa: E402
import torch_xla  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _timing import print_table  # noqa: E402

H, B = 16, 4
LENGTHS = (1_000, 3_000, 10_000, 30_000, 100_000)
MODES = {  # name: (ys stacked, training)
    "fwd_ys": (True, False), "fwd": (False, False), "train": (False, True), "train_ys": (True, True),
}
DEV = torch_xla.device()
WIDTH, ROWS = 256, 1024
THUNK_ROUNDS = 5


def body(w, with_ys):
    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, (c.sum(-1) if with_ys else None)
    return step


def make_call(n, with_ys, train):
    from torch_scan_hop import scan

    g = torch.Generator().manual_seed(n)
    w = (torch.randn(H, H, generator=g) * 0.1).to(DEV).requires_grad_(train)
    xs = torch.randn(n, B, H, generator=g).to(DEV).requires_grad_(train)
    c0 = torch.zeros(B, H).to(DEV)

    def call():
        w.grad = xs.grad = None
        c, ys = scan(body(w, with_ys), c0, xs)
        if train:
            loss = c.sum() + (ys.sum() if with_ys else 0)
            loss.backward()
            outs = [w.grad, xs.grad]
        else:
            outs = [c] + ([ys] if with_ys else [])
        torch_xla.sync()
        for o in outs:
            o.cpu()
    return call


def per_step(n, with_ys, train, repeat):
    call = make_call(n, with_ys, train)
    for _ in range(2):  # first call compiles, second is Dynamo's capture (docs/design.md)
        call()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        call()
        best = min(best, time.process_time() - t0)
    return best / n


def layer_step(layers, x, stacked, unroll=1, no_shift=False, keep_ys=False, txla=False):
    from torch_scan_hop import scan_layers
    from torch_scan_hop.trace import shift
    from torch_scan_hop.xla import kept_ys

    def run():
        if no_shift:  # the call's plan keeps every saved carry
            with unittest.mock.patch.object(shift, "use_shift", lambda *args: False):
                return step()
        if keep_ys:  # the stacked ys buffers kept between steps (xla/kept_ys.py)
            with unittest.mock.patch.dict(os.environ, {kept_ys.ENV: "1"}):
                return step()
        return step()

    def step():
        layers.zero_grad(set_to_none=True)
        h = x
        if txla:  # torch_xla's own; is_layer_pure: its traced layer cached between calls (its fast form)
            from torch_xla.experimental.scan_layers import scan_layers as txla_scan_layers
            h = txla_scan_layers(layers, h, is_layer_pure=True)
        elif stacked:
            h = scan_layers(layers, h, unroll=unroll)
        else:
            for layer in layers:
                h = layer(h)
        h.pow(2).mean().backward()
        grads = [p.grad for p in layers.parameters()]
        torch_xla.sync()
        torch_xla._XLAC._xla_wait_device_ops([])  # noqa: SLF001  (the step's device work, not only its launch)
        return grads
    return run


def ratio_cells(times, loop_times, depth):
    """A column's cells against the loop's, from the same interleaved rounds: ms per layer (best),
    best/best, the median of the per-round ratios [95% interval], their min-max."""
    from _timing import paired_ratio

    best, loop = min(times), min(loop_times)
    ratios = sorted(a / b for a, b in zip(times, loop_times))
    med, lo, hi = paired_ratio(times, loop_times)
    return [f"{best / depth * 1e3:.3f}", f"{best / loop:.2f}x", f"{med:.2f}x [{lo:.2f}, {hi:.2f}]",
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}"]


def layers_table(depths, repeat, clock=time.process_time, stacked=False, thunks=False, no_shift=False, keep_ys=False,
                 txla=False):
    from _timing import interleaved_times, paired_ratio
    from torch_scan_hop import stack_layers

    rows = []
    labels = {"scan_layers": "scan_layers", "while": "unroll=1", "unrolled": "unroll=depth"}  # form: column
    if stacked:
        labels["stacked_g"] = "stacked_g"
    if no_shift:
        labels["no_shift"] = "no_shift"
    if keep_ys:
        labels["keep_ys"] = "keep_ys"
    if txla:
        labels["txla"] = "torch_xla scan_layers"
    for depth in depths:
        torch.manual_seed(depth)
        make = lambda: torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())  # noqa: E731
        layers = torch.nn.ModuleList(make() for _ in range(depth)).to(DEV)
        x = torch.randn(ROWS, WIDTH).to(DEV)
        fns = {"loop": layer_step(layers, x, False), "scan_layers": layer_step(layers, x, True, unroll=None),
               "while": layer_step(layers, x, True), "unrolled": layer_step(layers, x, True, unroll=depth)}
        if stacked:  # a copy whose stacks are the trained parameters: no per-call stack, one grad per stack
            fns["stacked_g"] = layer_step(stack_layers(copy.deepcopy(layers), grads="stacked"), x, True, unroll=None)
        if no_shift:
            fns["no_shift"] = layer_step(layers, x, True, unroll=None, no_shift=True)
        if keep_ys:
            fns["keep_ys"] = layer_step(layers, x, True, unroll=None, keep_ys=True)
        if txla:
            fns["txla"] = layer_step(layers, x, True, txla=True)
        firsts, failed = {}, {}
        for name, fn in list(fns.items()):  # first call compiles; the scan's second is Dynamo's capture
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # noqa: BLE001  (torch_xla's scan_layers may not take this case: say why)
                if name != "txla":
                    raise
                failed[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                del fns[name]
                continue
            firsts[name] = time.perf_counter() - t0
        print(f"depth {depth}, first call (s):", ", ".join(f"{n} {t:.2f}" for n, t in firsts.items()), flush=True)
        rounds = interleaved_times(fns, repeat, clock=clock)
        loop = min(rounds["loop"])
        row = [depth, f"{loop / depth * 1e3:.3f}"]
        for name in labels:
            if name in failed:
                row += [failed[name], "-", "-", "-"]
                continue
            row += ratio_cells(rounds[name], rounds["loop"], depth)
        for name in ("no_shift", "keep_ys"):  # the question such a column asks: faster than the default or not
            if name in labels:
                med, lo, hi = paired_ratio(rounds[name], rounds["scan_layers"])
                row.append(f"{med:.3f}x [{lo:.3f}, {hi:.3f}]")
        rows.append(row)
        print(*rows[-1], flush=True)
        if thunks:
            from _xla_thunks import print_thunks, thunk_times
            # at most THUNK_ROUNDS profiled rounds: the profiler's event buffer holds depth 8's for 7, not 9
            profiled = {name: fns[name] for name in ("loop", "scan_layers", "keep_ys") if name in fns}
            print_thunks(thunk_times(profiled, min(repeat, THUNK_ROUNDS)))
    print(f"XLA, one thread ({'wall clock, pinned to one core' if clock is time.perf_counter else 'CPU time'}): training step of Linear({WIDTH}, {WIDTH}) + GELU stacks on {ROWS} rows, best of {repeat}; "
          f"per-round ratios: median [95% interval], min-max; load {os.getloadavg()[0]:.1f}")
    print_table(["depth", "loop ms/layer"] + [f"{label} {c}" for label in labels.values()
                                              for c in ("ms/layer", "best/best", "round median", "rounds")]
                + [f"{name} / scan_layers round median" for name in ("no_shift", "keep_ys") if name in labels], rows)


def jax_table(depths, repeat, clock):
    """JAX's own scan against its own unrolled loop, same stack and step (_xla_long_jax.py: a
    process of its own, since JAX and torch_xla both bring an XLA): the reference for our ratio."""
    import importlib.util

    from _xla_long_jax import FORMS, rounds

    if importlib.util.find_spec("jax") is None:
        print("jax is not installed (pip install -e '.[bench]'): no JAX table.")
        return
    wall = clock is time.perf_counter
    res, why = rounds(depths, repeat, "wall" if wall else "cpu", WIDTH, ROWS)
    if res is None:
        print(f"JAX table: {why}")
        return
    rows = []
    for depth in depths:
        r = res[str(depth)]["rounds"]
        loop = min(r["loop"])
        row = [depth, f"{loop / depth * 1e3:.3f}"]
        for form in FORMS[1:]:
            row += ratio_cells(r[form], r["loop"], depth)
        rows.append(row)
    version = res[str(depths[0])]["version"]
    print(f"JAX {version} on the CPU, one thread ({'wall clock, pinned to one core' if wall else 'CPU time'}): "
          f"jax.jit(value_and_grad) of the same stack (grads of the weights, biases and input), lax.scan vs the "
          f"layers unrolled in one jit, best of {repeat}; per-round ratios: median [95% interval], min-max; "
          f"load {os.getloadavg()[0]:.1f}")
    print_table(["depth", "jax loop ms/layer"] + [f"{label} {c}" for label in ("lax.scan", "lax.scan, stacked in step")
                                                  for c in ("ms/layer", "best/best", "round median", "rounds")], rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-len", type=int, default=LENGTHS[-1])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--depths", default="8,32,64")
    parser.add_argument("--one-core", action="store_true", help="pin to one core, time the wall clock")
    parser.add_argument("--stacked", action="store_true", help="a column for stack_layers(layers, grads='stacked')")
    parser.add_argument("--no-shift", action="store_true", help="a column for the default scan without shifted carries")
    parser.add_argument("--thunks", action="store_true", help="device time per XLA thunk kind, loop and scan_layers")
    parser.add_argument("--keep-ys", action="store_true", help="a column for the default scan with its stacked ys kept")
    parser.add_argument("--txla", action="store_true", help="a column for torch_xla's own scan_layers")
    parser.add_argument("--jax", action="store_true", help="a table of jax.lax.scan vs its unrolled loop, same stack")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch_scan_hop  # noqa: F401

    depths = [int(d) for d in args.depths.split(",") if int(d)]
    lengths = [n for n in LENGTHS if n <= args.max_len]
    rows = []
    for mode in filter(None, args.modes.split(",")):
        with_ys, train = MODES[mode]
        times = [per_step(n, with_ys, train, args.repeat) for n in lengths]
        for n, t in zip(lengths, times):
            rows.append([mode, n, f"{t * n * 1e3:.1f}", f"{t * 1e6:.2f}", f"{t / times[0]:.2f}x"])
            print(*rows[-1], flush=True)
    print(f"XLA on {os.environ['PJRT_DEVICE']}, one thread: tanh RNN H={H} B={B}, steady call, best of {args.repeat}")
    if rows:
        print_table(["mode", "T", "ms/call", "us/step", "vs T=1k"], rows)
    clock = time.perf_counter if args.one_core else time.process_time
    if depths:
        layers_table(depths, args.repeat, clock, args.stacked, args.thunks, args.no_shift, args.keep_ys, args.txla)
    if depths and args.jax:
        jax_table(depths, args.repeat, clock)


if __name__ == "__main__":
    main()
