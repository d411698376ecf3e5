"""jax.jit(jax.lax.scan) vs our compiled scan (inductor's default Python wrapper, and its C++
wrapper: ``options={"cpp_wrapper": True}``, where the loop itself runs in C++) vs the compiled
Python loop, on the same bodies.

The scan people compare us with is JAX's (issue 40). Bodies: the tanh RNN cell (H=64, B=8:
``c = tanh(c @ W + x); y = c.sum(-1)``) and the 4-layer MLP body of ``backward.py`` (H=256,
batch 64: ``h = c + x``, four ``tanh(Linear(h))``, ``y = h.mean(-1)``), float32, T=16/256/1024.
Forward (``(c, ys)``) and training step (loss ``c.sum() + ys.sum()``, gradients of the weights,
init and xs: ``jax.value_and_grad`` under ``jax.jit``; ``torch.autograd.grad`` of a compiled
loss). Each side runs in a process of its own, one thread on both: ``torch.set_num_threads(1)``
and ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"``; inductor's
caches off (first calls are compiles, not cache hits); jax results ``block_until_ready``. Steady
times are best of N calls (fewer where N calls would take over ~2 s, at least 3); "first" is the
first call (trace, compile and one run), after a tiny compile (a matmul and a tanh, forward and
gradient) that pays for each library's imports and once-per-process start-up (and, on a machine's
first run, for inductor's precompiled header and our loop kernel's: ``prepare_header``). The compiled loop
is skipped above T=256 for the RNN and above T=16 for the MLP (inductor compiles every unrolled
step: minutes on 2 cores). The inputs come from one numpy seed, and the losses of the three sides are compared.

jax is optional (``pip install -e '.[bench]'``): without it the jax columns say so and the
ours is compared with the compiled loop instead. ``--bodies rnn,rnn_no_tanh,rnn_no_mm`` adds the
RNN's step less its tanh (``(c @ W + x) * 0.5``) and less its matmul (``tanh(c * 0.5 + x)``):
their differences to the full step are what the tanh and the matmul cost on each side.
``--sides jax,scan`` runs only those sides (all four by default). ``--clock cpu``: steady times in
the process's CPU time (all threads; steadier on a busy box). ``--passes-off fast_tanh`` runs
ours with those codegen passes off (what each is worth: ``fast_tanh`` is the tanh in our loops).
Run: python benchmarks/jax_parity.py [--lengths 16,256,1024] [--bodies rnn,mlp] [--sides ...] [--repeat 20]
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
}
LOOP_MAX_T = {"rnn": 256, "mlp": 16, "rnn_no_tanh": 256, "rnn_no_mm": 256}  # the compiled loop unrolls every step
SHAPES = {"rnn": {"H": 64, "B": 8}, "mlp": {"H": 256, "B": 64, "layers": 4},
          "rnn_no_tanh": {"H": 64, "B": 8}, "rnn_no_mm": {"H": 64, "B": 8}}
MARK = "@@jax-parity@@ "
PASSES_OFF = "JAX_PARITY_PASSES_OFF"
CLOCK = "JAX_PARITY_CLOCK"


def make_inputs(body, t):
    """numpy float32 arrays (params, c0, xs), the same on every side."""
    import numpy as np

    rng = np.random.default_rng(t)
    h, b = SHAPES[body]["H"], SHAPES[body]["B"]
    f32 = lambda *shape, scale=1.0: (rng.standard_normal(shape) * scale).astype(np.float32)
    if body.startswith("rnn"):
        params = [f32(h, h, scale=0.1)]
    else:  # Linear weights stored (in, out), as h @ W + b reads them on both sides
        params = [p for _ in range(SHAPES[body]["layers"]) for p in (f32(h, h, scale=h ** -0.5), f32(h, scale=0.1))]
    return params, f32(b, h, scale=0.5), f32(t, b, h, scale=0.5)


def _progress(side, body, t, mode, result):
    print(f"#   {side} {body} T={t} {mode}: first {result['first']:.2f} s, steady {result['steady'] * 1e3:.3f} ms",
          file=sys.stderr, flush=True)
    return result


def _clock():
    """--clock (handed to the workers as CLOCK): the wall clock, or the process's CPU time (all
    its threads: XLA's run on its own), steadier on a shared box."""
    return time.process_time if os.environ.get(CLOCK) == "cpu" else time.perf_counter


def best_of(fn, n, budget_s=2.0):
    """Best time of up to ``n`` calls of ``fn`` (warm), stopping after ``budget_s`` (3 calls at least)."""
    best, spent, done, clock = float("inf"), 0.0, 0, _clock()
    while done < n and (done < 3 or spent < budget_s):
        t0 = clock()
        fn()
        dt = clock() - t0
        best, spent, done = min(best, dt), spent + dt, done + 1
    return best


def body_of(body, params, tanh):
    """One step of ``body`` (same code for jax arrays and torch tensors; ``tanh`` is the library's)."""
    def rnn(c, x):
        c = tanh(c @ params[0] + x)
        return c, c.sum(-1)

    def mlp(c, x):
        h = c + x
        for w, b in zip(params[::2], params[1::2]):
            h = tanh(h @ w + b)
        return h, h.mean(-1)

    def rnn_no_tanh(c, x):  # the RNN's step less its tanh (where a step's time goes) ...
        c = (c @ params[0] + x) * 0.5
        return c, c.sum(-1)

    def rnn_no_mm(c, x):  # ... and less its matmul
        c = tanh(c * 0.5 + x)
        return c, c.sum(-1)

    return {"rnn": rnn, "mlp": mlp, "rnn_no_tanh": rnn_no_tanh, "rnn_no_mm": rnn_no_mm}[body]


# ---- the jax side -------------------------------------------------------------------------------

def jax_worker(cases, repeat):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the comparison is on the CPU, single-threaded
    import jax
    import jax.numpy as jnp

    def forward(body):
        return jax.jit(lambda params, c0, xs: jax.lax.scan(body_of(body, params, jnp.tanh), c0, xs))

    def loss(body):
        def f(params, c0, xs):
            c, ys = jax.lax.scan(body_of(body, params, jnp.tanh), c0, xs)
            return c.sum() + ys.sum()
        return f

    def measure(body, t, mode):
        params, c0, xs = (jax.device_put(a) for a in _tree(make_inputs(body, t)))
        fn = forward(body) if mode == "fwd" else jax.jit(jax.value_and_grad(loss(body), argnums=(0, 1, 2)))
        call = lambda: jax.block_until_ready(fn(params, c0, xs))
        t0 = time.perf_counter()
        res = call()
        first = time.perf_counter() - t0
        value = float(res[0].sum() + res[1].sum()) if mode == "fwd" else float(res[0])
        return _progress("jax", body, t, mode, {"first": first, "steady": best_of(call, repeat), "loss": value})

    w = jnp.ones((16, 16))  # imports and backend start-up: a matmul, a tanh and a row sum, as torch's warm-up
    jax.block_until_ready(jax.jit(jax.grad(lambda x: jnp.tanh(x @ w).sum(-1).sum()))(jnp.ones((8, 16))))
    return {f"{body}/{t}/{mode}": measure(body, t, mode) for body, t, mode in cases}


def _tree(arrays):
    params, c0, xs = arrays
    return list(params), c0, xs


# ---- the torch side (ours, or the compiled loop) --------------------------------------------------

def torch_worker(cases, repeat, impl):
    import torch

    torch.set_num_threads(1)
    if impl.startswith("scan"):
        from torch_scan_hop import scan
    else:
        scan = None
    options = {"cpp_wrapper": True} if impl == "scan_cpp" else None  # the loop runs in C++

    def run(body, params, c0, xs):
        step = body_of(body, params, torch.tanh)
        if scan is not None:
            return scan(step, c0, xs)
        c, ys = c0, []
        for x in xs:
            c, y = step(c, x)
            ys.append(y)
        return c, torch.stack(ys)

    def loss(body, params, c0, xs):
        c, ys = run(body, params, c0, xs)
        return c.sum() + ys.sum()

    def measure(body, t, mode):
        torch._dynamo.reset()
        params, c0, xs = make_inputs(body, t)
        params, c0, xs = [torch.from_numpy(p) for p in params], torch.from_numpy(c0), torch.from_numpy(xs)
        if mode == "fwd":
            compiled = torch.compile(lambda p, c0, xs: run(body, p, c0, xs), fullgraph=True, options=options)
            call = lambda: compiled(params, c0, xs)
            value = lambda res: float(res[0].sum() + res[1].sum())
        else:
            compiled = torch.compile(lambda p, c0, xs: loss(body, p, c0, xs), fullgraph=True, options=options)
            inputs = [*(p.requires_grad_() for p in params), c0.requires_grad_(), xs.requires_grad_()]

            def call():
                value = compiled(inputs[:-2], inputs[-2], inputs[-1])
                return value, torch.autograd.grad(value, inputs)

            value = lambda res: float(res[0])
        t0 = time.perf_counter()
        res = call()
        first = time.perf_counter() - t0
        return _progress(impl, body, t, mode, {"first": first, "steady": best_of(call, repeat), "loss": value(res)})

    # imports, AOTAutograd and the C++ toolchain start-up, and what inductor does once per process
    # at its first matmul (hashing triton's sources for its autotuning cache) and at its first
    # kernel with a tiled loop (sympy.simplify imports sympy.physics): not the scan's compile
    warm, w = torch.ones(8, 16, requires_grad=True), torch.ones(16, 16)
    torch.autograd.grad(torch.compile(lambda x: torch.tanh(x @ w).sum(-1).sum())(warm), warm)
    if scan is not None:  # our loop kernel's precompiled header: once per machine, as inductor's own above
        from torch_scan_hop.inductor.codegen.kernel_build import prepare_header

        prepare_header()
    with _passes_off():
        return {f"{body}/{t}/{mode}": measure(body, t, mode) for body, t, mode in cases
                if scan is not None or t <= LOOP_MAX_T[body]}


def _passes_off():
    """``--passes-off`` (handed to the workers as PASSES_OFF): our codegen passes turned off, to
    measure what one of them is worth (e.g. ``fast_tanh``)."""
    import contextlib

    names = [n for n in os.environ.get(PASSES_OFF, "").split(",") if n]
    if not names:
        return contextlib.nullcontext()
    from torch_scan_hop.inductor import codegen

    return codegen.passes_off(*names)


# ---- the driver -----------------------------------------------------------------------------------

def run_side(side, cases, repeat):
    """One side's results in a fresh process, single-threaded; None if it failed."""
    env = dict(os.environ, **ONE_THREAD)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--repeat", str(repeat),
           "--cases", json.dumps(cases)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, env=env, stdout=subprocess.PIPE, text=True)  # stderr: progress
    print(f"# {side}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    print(f"# {side} failed (exit {proc.returncode}; its stderr is above)", file=sys.stderr)
    return None


def _ms(v):
    return "-" if v is None else f"{v * 1e3:.3f} ms" if v < 0.1 else f"{v * 1e3:.1f} ms"


def _s(v):
    return "-" if v is None else f"{v:.2f} s"


def _cell(results, key, field, base, fmt):
    """``fmt(value)`` and, when there is a jax value, ``(N.Nx)`` against it."""
    v = (results.get(key) or {}).get(field) if results is not None else None
    if v is None:
        return "-"
    b = (base.get(key) or {}).get(field) if base is not None else None
    return fmt(v) + (f" ({v / b:.1f}x)" if b else "")


def report(bodies, lengths, sides):
    from _timing import print_table

    jax_res = sides.get("jax")
    base, against = (jax_res, "jax.jit(lax.scan)") if jax_res else (sides.get("loop"), "the compiled loop")
    for body in bodies:
        for field, fmt, title in (("steady", _ms, "steady call, best of N"), ("first", _s, "first call (compile)")):
            rows = []
            for t in lengths:
                row = [t]
                for mode in ("fwd", "train"):
                    key = f"{body}/{t}/{mode}"
                    row.append(_cell(jax_res, key, field, None, fmt) if jax_res is not None else "(no jax)")
                    row.append(_cell(sides.get("scan"), key, field, base, fmt))
                    row.append(_cell(sides.get("scan_cpp"), key, field, base, fmt))
                    row.append(_cell(sides.get("loop"), key, field, jax_res, fmt) if t <= LOOP_MAX_T[body]
                               else "(compile too long)")
                rows.append(row)
            print(f"\n{body} {SHAPES[body]}, {title}; (Nx) = x {against}")
            print_table(["T", "jax fwd", "ours fwd", "ours C++ wrapper fwd", "compiled loop fwd",
                         "jax train", "ours train", "ours C++ wrapper train", "compiled loop train"], rows)
    _check_losses(sides)


def _check_losses(sides):
    """The three sides computed the same thing (float32, different summation orders)."""
    keys = set().union(*(r.keys() for r in sides.values() if r))
    for key in sorted(keys):
        values = {side: r[key]["loss"] for side, r in sides.items() if r and key in r}
        ref = next(iter(values.values()))
        if any(abs(v - ref) > 1e-3 * max(1.0, abs(ref)) for v in values.values()):
            print(f"LOSS MISMATCH {key}: {values}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="16,256,1024")
    parser.add_argument("--bodies", default="rnn,mlp")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--sides", default="jax,scan,scan_cpp,loop")
    parser.add_argument("--worker", choices=["jax", "scan", "scan_cpp", "loop"])
    parser.add_argument("--cases")
    parser.add_argument("--passes-off", default="", help="our codegen passes to turn off, comma-separated (fast_tanh, ...)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="steady times by the wall clock or the process's CPU time (first calls: wall)")
    args = parser.parse_args()
    os.environ[CLOCK] = args.clock
    if args.passes_off:
        os.environ[PASSES_OFF] = args.passes_off
    if args.worker:
        cases = json.loads(args.cases)
        out = jax_worker(cases, args.repeat) if args.worker == "jax" else torch_worker(cases, args.repeat, args.worker)
        print(MARK + json.dumps(out), flush=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    bodies, lengths = args.bodies.split(","), [int(t) for t in args.lengths.split(",")]
    cases = [(b, t, m) for b in bodies for t in lengths for m in ("fwd", "train")]
    wanted, sides = args.sides.split(","), {}
    if "jax" in wanted and importlib.util.find_spec("jax") is None:
        print("jax is not installed (pip install -e '.[bench]'): the jax columns are skipped.")
    elif "jax" in wanted:
        sides["jax"] = run_side("jax", cases, args.repeat)
    for side in ("scan", "scan_cpp", "loop"):
        sides[side] = run_side(side, cases, args.repeat) if side in wanted else None
    report(bodies, lengths, sides)


if __name__ == "__main__":
    main()
