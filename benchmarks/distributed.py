"""Sharded models, both tables in one run: FSDP2 (``distributed_fsdp.py``: the FSDP2 loop vs
scan_layers, eager and compiled, 2 gloo processes, depth 8 and 32) and XLA SPMD
(``distributed_spmd.py``: scan_layers vs the loop on 4 virtual CPU devices, depth 8/32/64).
Each script also runs alone, with its own options. About 5 minutes on 2 cores.

Run: python benchmarks/distributed.py
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    for script in ("distributed_fsdp.py", "distributed_spmd.py"):  # each in a process of its own
        print(f"== {script}", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, script)], check=True)


if __name__ == "__main__":
    main()
