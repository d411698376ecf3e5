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
a step ends when XLA's device work does, and "first" is the first two steps (a scanned stack's second
step compiles again: it runs on the weights stacked by the first). ``--unroll 1`` makes every scan a
While (XLA's default runs a short stack straight-line).
Run: python benchmarks/models.py [--families llama,gemma3] [--depths 4,16] [--backend inductor|none|openxla]
     [--device cpu|xla] [--unroll N] [--reps 10]
"""
import argparse
import copy
import os
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


def _step(model, fn, tokens):
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    _, loss = fn(model, tokens)
    loss.backward()
    _wait(tokens)
    return time.perf_counter() - t0


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "xla":
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla  # noqa: PLC0415

        device = torch_xla.device()
    tokens = ids(batch=2, length=16).to(device)
    rows = []
    for family in args.families.split(","):
        firsts = {}
        for depth in map(int, args.depths.split(",")):
            torch.manual_seed(0)
            loop = build(family, depth)
            scanned = scan_model(copy.deepcopy(loop), unroll=args.unroll).to(device)
            loop = loop.to(device)
            lf, ls = measure(loop, args.backend, tokens, args.reps)
            sf, ss = measure(scanned, args.backend, tokens, args.reps)
            firsts[depth] = (lf, sf)
            rows.append([family, depth, f"{lf:.1f}", f"{sf:.1f}", f"{sf / lf:.2f}x", f"{ls * 1e3:.1f}",
                         f"{ss * 1e3:.1f}", f"{ss / ls:.2f}x"])
        lo, hi = min(firsts), max(firsts)
        rows.append([family, f"{hi}/{lo}", f"{firsts[hi][0] / firsts[lo][0]:.2f}x",
                     f"{firsts[hi][1] / firsts[lo][1]:.2f}x", "", "", "", ""])
    print(f"device={args.device}, backend={args.backend}, unroll={args.unroll}, torch {torch.__version__}, "
          "one thread, batch 2 x 16 tokens")
    print_table(["family", "depth", "loop first s", "scan first s", "scan/loop", "loop step ms", "scan step ms",
                 "scan/loop"], rows)


if __name__ == "__main__":
    main()
