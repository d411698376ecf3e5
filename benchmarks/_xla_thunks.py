"""Where an XLA (CPU) step's device time goes: the time of each thunk kind, from torch_xla's profiler.

XLA's CPU runtime runs a compiled program as thunks (a dot, a fusion, a While and the thunks of its
body), each recorded by the profiler with its HLO name. ``thunk_times`` runs each step function a
few times under the profiler and returns, per function, the device time of each kind of thunk (the
name less its number; every ``dot`` one kind; inside a While prefixed by the While's name), least
over the rounds. Used by ``xla_long.py --thunks`` to tell apart what a scan's While adds to a
step (its stacked buffers' fills, row copies, the rebuilt carries) from the dots both forms share.
The profiler keeps a bounded number of events: at depth 8 of ``xla_long.py`` (7 rounds) every
thunk is there; at depth 32 most are lost, which is said rather than summed.
"""
import collections
import glob
import gzip
import json
import os
import re
import tempfile

# not thunks: executor spans, end marks, and the transposes a copy thunk runs (nested in it)
_SKIP = re.compile(r"ThunkExecutor|^end:|^Transpose|Threadpool")


_server = []


def _executions(events):
    """The outermost ThunkExecutor::Execute events of at least 1 ms (one per step's program; the
    small programs some steps run besides are left out), in time order."""
    outer = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["name"] != "ThunkExecutor::Execute" or e["dur"] < 1000:
            continue
        if outer and e["ts"] < outer[-1]["ts"] + outer[-1]["dur"]:
            continue
        outer.append(e)
    return outer


def _kinds(events, run):
    """{kind: microseconds} of the leaf thunks inside one program run, its total and the time in it
    when no thunk of its thread ran ("(between thunks)": measured in this run, so the least over
    rounds is one round's; the total's least less the sum of each kind's least was not, and
    overstated it)."""
    inside = [e for e in events if e["tid"] == run["tid"] and run["ts"] <= e["ts"] < run["ts"] + run["dur"]
              and e is not run]
    whiles = [e for e in inside if "while" in e["name"] and not e["name"].startswith("end")]
    sums = collections.Counter()
    leaves = []
    for e in inside:
        if _SKIP.search(e["name"]) or e in whiles:
            continue
        leaves.append(e)
        where = [w["name"] for w in whiles if w["ts"] <= e["ts"] < w["ts"] + w["dur"]]
        kind = "dot" if e["name"].startswith("dot") else re.sub(r"\.\d+$", "", e["name"])
        sums[(where[-1] + ": " if where else "") + kind] += e["dur"]
    sums["(total)"] = run["dur"]
    sums["(between thunks)"] = run["dur"] - _covered(leaves)
    return sums


def _covered(events):
    """Microseconds covered by at least one of the events (their intervals' union)."""
    covered, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        stop = e["ts"] + e["dur"]
        if stop > end:
            covered += stop - max(e["ts"], end)
            end = stop
    return covered


def thunk_times(fns, rounds=5):
    """``{name: {kind: least ms over the rounds}}`` for step functions ``fns`` ({name: fn}),
    each of which runs exactly one XLA program (its sync) per call; already warm (compiled)."""
    import torch_xla.debug.profiler as xp

    out = tempfile.mkdtemp(prefix="xla_thunks_")
    if not _server:  # one per process
        _server.append(xp.start_server(9012))
    xp.start_trace(out)
    for _ in range(rounds):
        for fn in fns.values():
            fn()
    xp.stop_trace()
    (path,) = glob.glob(os.path.join(out, "plugins", "profile", "*", "*.trace.json.gz"))
    events = [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]
    runs = _executions(events)
    per = {name: collections.defaultdict(list) for name in fns}
    for i, run in enumerate(runs[-rounds * len(fns):]):
        name = list(fns)[i % len(fns)]
        for kind, us in _kinds(events, run).items():
            per[name][kind].append(us / 1e3)
    result = {}
    for name, kinds in per.items():
        least = {k: min(v) for k, v in kinds.items() if len(v) == rounds}
        total = least.get("(total)", 0.0)
        if sum(ms for k, ms in least.items() if not k.startswith("(")) < 0.8 * total:  # the profiler dropped events
            least = {"(total)": total, "(the profile lost most thunks: too many events; fewer layers or rounds)": 0.0}
        result[name] = least
    return result


def print_thunks(times, min_ms=0.05):
    """One line per thunk kind (ms, least over the rounds), for each step function."""
    for name, kinds in times.items():
        print(f"{name}: device ms per step by thunk kind (least over rounds)")
        for kind, ms in sorted(kinds.items(), key=lambda t: -t[1]):
            if ms >= min_ms or kind.startswith("("):
                print(f"  {ms:8.3f}  {kind}")
