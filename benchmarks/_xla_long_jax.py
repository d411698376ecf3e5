"""JAX's reference rows for ``xla_long.py --jax``: the same layer stack's training step in JAX.

Why: the layer-stack table says how our ``While`` compares with the Python loop on XLA CPU; the
reader needs to know what the other scans achieve on the same backend, measured the same way,
to judge that ratio. Same stack as xla_long.py's: per layer ``gelu(h @ W.T + b)`` (exact GELU,
the erf form), float32, nn.Linear's default init, ``ROWS`` x ``WIDTH`` input; the step is
``jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))`` of ``loss = mean(h ** 2)`` (as the torch
step's ``h.pow(2).mean()``) w.r.t. the parameters AND the input (the torch step takes no input
gradient: one more [ROWS, WIDTH] x [WIDTH, WIDTH] dot per step, on every JAX form alike). Forms:

- ``loop``: the layers as a Python loop unrolled under one ``jax.jit``, per-layer (W, b) arrays
  (as the torch loop's per-layer parameters);
- ``scan``: ``jax.lax.scan`` over stacked [depth, ...] weights and biases (the stacks are the
  arguments, and their gradients come back stacked);
- ``scan_stack``: the per-layer arrays stacked inside the step, then ``lax.scan`` (what our
  default ``scan_layers`` does per call, and what the earlier one-off measurement timed).

JAX and torch_xla both bring an XLA, so this runs in a process of its own (as jax_parity.py's
workers), started by ``rounds``; it inherits the parent's XLA_FLAGS (one thread) and its CPU
mask (``--one-core``). Rounds interleave the forms (``_timing.interleaved_times``), timed by the
parent's clock; a call ends with ``block_until_ready``.
Run (standalone): python benchmarks/_xla_long_jax.py --worker '{"depths": [8], "repeat": 3, ...}'
"""
import json
import os
import subprocess
import sys
import time

MARK = "@@xla-long-jax@@ "
FORMS = ("loop", "scan", "scan_stack")


def _layer():
    import jax

    def layer(h, wb):
        w, b = wb
        return jax.nn.gelu(h @ w.T + b, approximate=False)
    return layer


def _steps(depth):
    """``{form: jitted value_and_grad}`` of the three forms (same loss on each)."""
    import jax
    import jax.numpy as jnp

    layer = _layer()

    def loop_loss(params, x):
        h = x
        for wb in params:  # unrolled: depth layers in one program
            h = layer(h, wb)
        return jnp.mean(h ** 2)

    def scan_loss(stacked, x):
        h, _ = jax.lax.scan(lambda h, wb: (layer(h, wb), None), x, stacked)
        return jnp.mean(h ** 2)

    def scan_stack_loss(params, x):
        stacked = (jnp.stack([w for w, _ in params]), jnp.stack([b for _, b in params]))
        return scan_loss(stacked, x)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))  # noqa: E731
    return {"loop": grad(loop_loss), "scan": grad(scan_loss), "scan_stack": grad(scan_stack_loss)}


def _inputs(depth, width, rows):
    """Per-layer (W, b) as nn.Linear's default init (uniform +-1/sqrt(in)), their stacks, and x."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(depth)
    bound = width ** -0.5
    ws = rng.uniform(-bound, bound, (depth, width, width)).astype(np.float32)
    bs = rng.uniform(-bound, bound, (depth, width)).astype(np.float32)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    params = [(jax.device_put(jnp.asarray(w)), jax.device_put(jnp.asarray(b))) for w, b in zip(ws, bs)]
    return params, (jax.device_put(jnp.asarray(ws)), jax.device_put(jnp.asarray(bs))), jax.device_put(jnp.asarray(x))


def worker(depths, repeat, clock, width, rows):
    """Per depth: the first call of each form (s), each form's time per round, and the losses."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from _timing import interleaved_times

    clock = time.perf_counter if clock == "wall" else time.process_time
    out = {}
    for depth in depths:
        steps = _steps(depth)
        params, stacked, x = _inputs(depth, width, rows)
        args = {"loop": params, "scan": stacked, "scan_stack": params}
        fns = {form: (lambda f=steps[form], p=args[form]: jax.block_until_ready(f(p, x))) for form in FORMS}
        firsts, losses = {}, {}
        for form, fn in fns.items():
            t0 = time.perf_counter()
            losses[form] = float(fn()[0])
            firsts[form] = time.perf_counter() - t0
        print(f"# jax depth {depth}, first call (s):", ", ".join(f"{f} {t:.2f}" for f, t in firsts.items()),
              "; losses:", ", ".join(f"{f} {v:.6g}" for f, v in losses.items()), file=sys.stderr, flush=True)
        out[str(depth)] = {"rounds": interleaved_times(fns, repeat, clock=clock), "firsts": firsts, "losses": losses,
                           "version": jax.__version__}
    return out


def rounds(depths, repeat, clock, width, rows):
    """The worker's results (``{depth: {...}}``) from a fresh process; None and why if it failed."""
    spec = {"depths": list(depths), "repeat": repeat, "clock": clock, "width": width, "rows": rows}
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)], check=False,
                          env=env, stdout=subprocess.PIPE, text=True)  # stderr: progress, and any traceback
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):]), None
    return None, f"jax worker exit {proc.returncode} (its stderr is above)"


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(MARK + json.dumps(worker(**json.loads(sys.argv[2]))), flush=True)
