"""scan_model vs the model's own loop: whole transformers models, first compiled call and steady step.

For each family and depth: a training step (forward through the model, next-token loss, backward)
compiled with the backend (inductor by default), on the model's own loop and on ``scan_model``'s
scans, each in a fresh Dynamo state. "first" is the first call (Dynamo + compile + one step),
"steady" the best of --reps steps after it. The scanned model's first call should not grow with
depth (goal: depth 16 within 1.3x of depth 4) where the loop's grows with every layer; the last
line per family gives that ratio for both. Tiny random configs (tests/hf_families.py), float32,
batch 2 x 16 tokens, one thread.
Run: python benchmarks/models.py [--families llama,gemma3] [--depths 4,16] [--backend inductor] [--reps 10]
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


def _step(model, fn, tokens):
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    _, loss = fn(model, tokens)
    loss.backward()
    return time.perf_counter() - t0


def measure(model, backend, tokens, reps):
    """(first call seconds, best steady step seconds) of the compiled training step."""
    torch._dynamo.reset()
    fn = torch.compile(logits_and_loss, backend=backend, fullgraph=True)
    model.train()
    first = _step(model, fn, tokens)
    steady = min(_step(model, fn, tokens) for _ in range(reps))
    return first, steady


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="llama,gemma3")
    parser.add_argument("--depths", default="4,16")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = ids(batch=2, length=16)
    rows = []
    for family in args.families.split(","):
        firsts = {}
        for depth in map(int, args.depths.split(",")):
            torch.manual_seed(0)
            loop = build(family, depth)
            scanned = scan_model(copy.deepcopy(loop))
            lf, ls = measure(loop, args.backend, tokens, args.reps)
            sf, ss = measure(scanned, args.backend, tokens, args.reps)
            firsts[depth] = (lf, sf)
            rows.append([family, depth, f"{lf:.1f}", f"{sf:.1f}", f"{sf / lf:.2f}x", f"{ls * 1e3:.1f}",
                         f"{ss * 1e3:.1f}", f"{ss / ls:.2f}x"])
        lo, hi = min(firsts), max(firsts)
        rows.append([family, f"{hi}/{lo}", f"{firsts[hi][0] / firsts[lo][0]:.2f}x",
                     f"{firsts[hi][1] / firsts[lo][1]:.2f}x", "", "", "", ""])
    print(f"backend={args.backend}, torch {torch.__version__}, one thread, batch 2 x 16 tokens")
    print_table(["family", "depth", "loop first s", "scan first s", "scan/loop", "loop step ms", "scan step ms",
                 "scan/loop"], rows)


if __name__ == "__main__":
    main()
