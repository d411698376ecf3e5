"""scan_model vs the model's own loop: whole transformers models, first compiled call and steady step.

For each family and depth: a training step (forward through the model, next-token loss, backward)
compiled with the backend (inductor by default), on the model's own loop and on ``scan_model``'s
scans, each in a fresh Dynamo state. "first" is the first call (Dynamo + compile + one step),
"steady" the best of --reps steps after it. The scanned model's first call should not grow with
depth (goal: depth 16 within 1.3x of depth 4) where the loop's grows with every layer; the last
line per family gives that ratio for both. Tiny random configs (tests/support/hf_families.py), float32,
batch 2 x 16 tokens, one thread.

``--device xla`` runs the same on PyTorch/XLA (``PJRT_DEVICE=CPU``): ``--backend none`` is the lazy
tensor path (trace, XLA compile, run at the sync), ``--backend openxla`` torch.compile's XLA backend;
a step ends when XLA's device work does, and "first" is the first two steps (before 2026-11-29 a
scanned stack's second step compiled again; now it compiles nothing). ``--unroll 1`` makes every scan a
While. Each family, depth and variant runs in a process of its own: the plans and compiled programs one depth
cached would otherwise make the next one's first call cheaper (a layer's body is the same at every
depth), and the ratio across depths meaningless.
Run: python benchmarks/models.py [--families llama,gemma3] [--depths 4,16] [--backend inductor|none|openxla]
     [--device cpu|xla] [--unroll N] [--reps 10] [--clock wall|cpu]
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
from _timing import print_table  # noqa: E402
from hf_families import build, ids, logits_and_loss  # noqa: E402

from torch_scan_hop import scan_model  # noqa: E402


def _wait(tokens):
    """Block until the step's device work is done (XLA runs a step at its sync)."""
    if tokens.device.type == "xla":
        import torch_xla  # noqa: PLC0415
        import torch_xla.core.xla_model as xm  # noqa: PLC0415

        torch_xla.sync()
        xm.wait_device_ops()


CLOCK = time.perf_counter  # --clock cpu: time.process_time (the process's CPU time, all its threads)


def _step(model, fn, tokens):
    model.zero_grad(set_to_none=True)
    t0 = CLOCK()
    _, loss = fn(model, tokens)
    loss.backward()
    _wait(tokens)
    return CLOCK() - t0


def measure(model, backend, tokens, reps):
    """(first call seconds, best steady step seconds) of the training step, compiled with
    ``backend`` (``none``: not compiled)."""
    torch._dynamo.reset()
    fn = logits_and_loss if backend == "none" else torch.compile(logits_and_loss, backend=backend, fullgraph=True)
    model.train()
    first = _step(model, fn, tokens)
    if tokens.device.type == "xla":  # scan_layers' second XLA step compiles too (it runs on the stacked weights)
        first += _step(model, fn, tokens)
    steady = min(_step(model, fn, tokens) for _ in range(reps))
    return first, steady


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="llama,gemma3")
    parser.add_argument("--depths", default="4,16")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu", choices=["cpu", "xla"])
    parser.add_argument("--unroll", type=int, default=None)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: the process's CPU time (steadier than the wall clock on a shared box)")
    parser.add_argument("--child", choices=["loop", "scan"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:
        return _parent(args)
    torch.set_num_threads(1)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    device = torch.device("cpu")
    if args.device == "xla":
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla  # noqa: PLC0415

        device = torch_xla.device()
    tokens = ids(batch=2, length=16).to(device)
    (family,), (depth,) = args.families.split(","), map(int, args.depths.split(","))
    torch.manual_seed(0)
    model = build(family, depth)
    if args.child == "scan":
        model = scan_model(model, unroll=args.unroll)
    print(json.dumps(measure(model.to(device), args.backend, tokens, args.reps)))


def _child(args, family, depth, variant):
    """(first, steady) seconds of one variant in a fresh process."""
    cmd = [sys.executable, __file__, "--child", variant, "--families", family, "--depths", str(depth),
           "--backend", args.backend, "--device", args.device, "--reps", str(args.reps), "--clock", args.clock]
    cmd += [] if args.unroll is None else ["--unroll", str(args.unroll)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _parent(args):
    """One child process per family and depth (see the module docstring); the table."""
    rows = []
    for family in args.families.split(","):
        firsts = {}
        for depth in map(int, args.depths.split(",")):
            (lf, ls), (sf, ss) = (_child(args, family, depth, variant) for variant in ("loop", "scan"))
            firsts[depth] = (lf, sf)
            rows.append([family, depth, f"{lf:.1f}", f"{sf:.1f}", f"{sf / lf:.2f}x", f"{ls * 1e3:.1f}",
                         f"{ss * 1e3:.1f}", f"{ss / ls:.2f}x"])
        lo, hi = min(firsts), max(firsts)
        rows.append([family, f"{hi}/{lo}", f"{firsts[hi][0] / firsts[lo][0]:.2f}x",
                     f"{firsts[hi][1] / firsts[lo][1]:.2f}x", "", "", "", ""])
    print(f"device={args.device}, backend={args.backend}, unroll={args.unroll}, clock={args.clock}, "
          f"torch {torch.__version__}, "
          "one thread, batch 2 x 16 tokens")
    print_table(["family", "depth", "loop first s", "scan first s", "scan/loop", "loop step ms", "scan step ms",
                 "scan/loop"], rows)


if __name__ == "__main__":
    main()
