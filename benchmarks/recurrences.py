"""Training steps of four recurrences as transformers writes them, against the same loops as ``scan``.

Mamba's selective scan, RWKV's wkv, xLSTM's mLSTM and RecurrentGemma's RG-LRU (the bodies and the
library callers are ``tests/support/foreign_recurrences.py``, which ``tests/differential/test_foreign_recurrences.py``
checks against the libraries). One training step: forward, a scalar loss of every output, and the
gradients w.r.t. every float input. Variants, each timed on the same inputs:

  scan compiled   - torch.compile (inductor, fullgraph) of the scan form (``--forms``: more forms)
  loop compiled   - torch.compile of the library's own function (its loop unrolls: T <= --loop-max-T)
  assoc compiled  - Mamba only: the library's ``use_associative_scan=True`` path, which runs only under
                    torch.compile (torch's private ``associative_scan``; where importable)
  loop eager      - the library's function (T <= --eager-max-T)
  scan eager      - the scan form in eager: the loop, run by ``scan`` (T <= --eager-max-T)

Two parts:
  first  - first call (trace + compile + run, s) of each compiled variant, each in a child process
           of its own with an empty inductor cache (after a warm-up compile there), so nothing is
           reused from another variant (--jobs children at a time, one compile thread each);
  steady - ms per call, best of --rounds interleaved rounds (CUDA: wall time, synchronized; CPU: the
           process's CPU time, one thread by default: the box is shared); Dynamo reset per
           (recurrence, T) so no variant compiles with dynamic shapes.
Sizes: batch 4, 256 channels (xLSTM: 4 heads of 64; Mamba: N=16), float32.
Run: python benchmarks/recurrences.py [--device cpu|cuda] [--recurrences mamba,rwkv,xlstm,rglru]
     [--lengths 256,1024,4096] [--loop-max-T 256] [--eager-max-T 1024] [--rounds 5] [--parts first,steady]
     [--forms scan,scan_write,scan_states] [--batch 4] [--channels 256] [--threads 1] [--quick]
--quick: lengths 256,1024, no compiled loop, eager up to 256, 3 rounds (a CUDA smoke run of ~1 minute).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
from foreign_recurrences import RECURRENCES, mamba_library  # noqa: E402
from _timing import interleaved_times, print_table  # noqa: E402

COMPILED = ("loop compiled", "assoc compiled")  # and "<form> compiled" for each --forms entry
HAS_ASSOCIATIVE_SCAN = importlib.util.find_spec("torch._higher_order_ops.associative_scan") is not None


def _sync(device):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _mamba_associative(**inputs):
    return mamba_library(**inputs, use_associative_scan=True)


def variant_fn(rec, variant):
    """The function a variant runs (compiled or not: ``variant`` ends in "compiled" or "eager")."""
    what = variant.rsplit(" ", 1)[0]
    if what == "loop":
        return rec.library
    if what == "assoc":
        return _mamba_associative
    return rec.forms[what]


def applies(rec, variant, t, args):
    if rec.library is None:
        return False
    if variant == "assoc compiled":
        return rec.name == "mamba" and HAS_ASSOCIATIVE_SCAN
    if variant == "loop compiled":
        return t <= args.loop_max_T
    if variant.endswith("compiled") and variant.rsplit(" ", 1)[0] not in rec.forms:
        return False  # a --forms entry this recurrence has no body for (scan_write: RWKV, RG-LRU)
    return variant.endswith("compiled") or t <= args.eager_max_T


def variants(args):
    return ([f"{f} compiled" for f in args.forms.split(",")] + list(COMPILED)
            + ["loop eager", "scan eager"])


def training_step(rec, variant, t, args):
    """A call running one training step of ``variant`` (compiled on its first call) and syncing."""
    inputs = {k: v.requires_grad_(v.is_floating_point())
              for k, v in rec.inputs(args.batch, t, args.channels, args.device, torch.float32).items()}
    leaves = [v for v in inputs.values() if v.requires_grad]
    fn = variant_fn(rec, variant)

    def loss(**inp):
        return sum(o.float().square().mean() for o in fn(**inp))
    if variant.endswith("compiled"):
        loss = torch.compile(loss, backend="inductor", fullgraph=True)
    sync = _sync(args.device)

    def step():
        grads = torch.autograd.grad(loss(**inputs), leaves, allow_unused=True)
        sync()
        return grads
    return step


def first_child(args):
    """One compiled variant's first call in this fresh process, after a warm-up compile."""
    name, variant, t = args.first_child
    torch.compile(lambda a: torch.tanh(a) + 1)(torch.ones(3, device=args.device))
    step = training_step(RECURRENCES[name], variant, int(t), args)
    t0 = time.perf_counter()
    step()
    print(json.dumps({"first": time.perf_counter() - t0}))


def _child_cmd(args, name, variant, t):
    keep = ["--device", args.device, "--batch", str(args.batch), "--channels", str(args.channels),
            "--threads", str(args.threads)]
    return [sys.executable, os.path.abspath(__file__), *keep, "--first-child", name, variant, str(t)]


def part_first(args, names, lengths):
    """Every compiled (recurrence, variant, T) first call in a process of its own, --jobs at a time."""
    todo = [(n, v, t) for n in names for t in lengths for v in variants(args)
            if v.endswith("compiled") and applies(RECURRENCES[n], v, t, args)]
    results, running = {}, []
    with tempfile.TemporaryDirectory() as root:
        while todo or running:
            while todo and len(running) < args.jobs:
                key = todo.pop(0)
                cache = os.path.join(root, "-".join(map(str, key)).replace(" ", "_"))
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
                running.append((key, subprocess.Popen(_child_cmd(args, *key), stdout=subprocess.PIPE,
                                                      stderr=subprocess.PIPE, text=True, env=env)))
            key, job = running.pop(0)
            try:
                out, err = job.communicate(timeout=args.child_timeout)
                results[key] = (f"{json.loads(out.strip().splitlines()[-1])['first']:.1f}" if job.returncode == 0
                                else f"failed: {err.strip().splitlines()[-1][:120] if err.strip() else job.returncode}")
            except subprocess.TimeoutExpired:
                job.kill()
                job.communicate()
                results[key] = f"> {args.child_timeout} s"
    cols = [v for v in variants(args) if v.endswith("compiled")]
    rows = [[n, t, *[results.get((n, v, t), "-") for v in cols]] for n in names for t in lengths]
    print(f"first call (s): trace + compile + run of one training step, each in a fresh process, "
          f"{_where(args)}")
    print_table(["recurrence", "T", *cols], rows)
    failures = [f"{k}: {v}" for k, v in results.items() if v.startswith(("failed", ">"))]
    print("\n".join(failures))


def _ms(times):
    return {k: min(v) * 1e3 for k, v in times.items()}


def part_steady(args, names, lengths):
    rows = []
    for name in names:
        rec = RECURRENCES[name]
        for t in lengths:
            torch._dynamo.reset()
            steps, notes = {}, []
            for v in variants(args):
                if not applies(rec, v, t, args):
                    continue
                try:
                    steps[v] = training_step(rec, v, t, args)
                    steps[v]()  # compiles
                except Exception as e:  # noqa: BLE001 - the table says which variant failed
                    steps.pop(v, None)
                    notes.append(f"{name} T={t} {v}: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            # on CPU (one thread) the process's CPU time: a shared box's other processes take the core in bursts
            clock = time.perf_counter if args.device == "cuda" else time.process_time
            best = _ms(interleaved_times(steps, repeat=args.rounds, clock=clock))
            scan_ms = best.get("scan compiled")
            cell = lambda v: f"{best[v]:.2f}" if v in best else "-"  # noqa: E731
            ratio = lambda v: f"{best[v] / scan_ms:.2f}x" if v in best and scan_ms else "-"  # noqa: E731
            rows.append([name, t, *[cell(v) for v in variants(args)],
                         ratio("loop eager"), ratio("loop compiled"), ratio("scan eager")])
            print("\n".join(notes), flush=True)
    what = "wall time" if args.device == "cuda" else "CPU time"
    print(f"steady ({what}, ms per training step, best of {args.rounds} interleaved rounds), {_where(args)}; "
          "ratios: that variant's time / scan compiled")
    print_table(["recurrence", "T", *variants(args), "loop eager/scan", "loop compiled/scan",
                 "scan eager/scan"], rows)


def _where(args):
    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    return f"{dev}, batch {args.batch}, {args.channels} channels, float32, torch {torch.__version__}"


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--recurrences", default=",".join(RECURRENCES))
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--loop-max-T", dest="loop_max_T", type=int, default=256)
    p.add_argument("--eager-max-T", dest="eager_max_T", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parts", default="first,steady")
    p.add_argument("--forms", default="scan")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (torch.set_num_threads; one: a kernel's OpenMP region waits ~10 ms for a "
                        "second thread the scheduler has given to another process on a shared box)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--child-timeout", dest="child_timeout", type=int, default=600)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--first-child", nargs=3)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.loop_max_T, args.eager_max_T, args.rounds = "256,1024", 0, 256, 3
    return args


def main():
    args = parse()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.first_child:
        return first_child(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/recurrences.py: no CUDA device here; nothing measured")
        return
    names = [n for n in args.recurrences.split(",") if RECURRENCES[n].library is not None]
    skipped = sorted(set(args.recurrences.split(",")) - set(names))
    if skipped:
        print("this transformers lacks: " + ", ".join(RECURRENCES[n].library_name for n in skipped))
    lengths = [int(v) for v in args.lengths.split(",")]
    for part in args.parts.split(","):
        {"first": part_first, "steady": part_steady}[part](args, names, lengths)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
