"""The checks of tests/distributed/test_distributed.py, run in each of 2 gloo processes on 127.0.0.1.

    python tests/distributed/_distributed_checks.py RANK WORLD PORT OUT.json
    SCAN_DIST_SUITE=2d python tests/distributed/_distributed_checks.py RANK 4 PORT OUT.json   (FSDP2 + TP)

Every check compares scan / scan_layers (eager and torch.compile) with the Python
loop it stands for, values and gradients, on both ranks; the results (None or the
error) are written to OUT.json. The process group is made once for all checks.
OUT.json is rewritten after every check and names the check under way ("__running__"),
so that a rank that dies (a segfault in torch) still says which check killed it, and
which passed before; faulthandler prints the Python stack of such a death. "__seconds__"
holds what each finished check took (where a suite's time goes, and which check a deadline cut).
"""
import collections
import copy
import datetime
import faulthandler
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torch_scan_hop import ScanError, scan, scan_layers, stack_layers

CHECKS = {}
CHECKS_2D = {}  # run by 4 processes on a (dp=2, tp=2) mesh: SCAN_DIST_SUITE=2d
MESH = []  # the 1-D mesh of every rank (MESH[0]); with SCAN_DIST_SUITE=2d, then the 2-D one (MESH[1])
ATOL = 1e-5


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def check_2d(fn):
    CHECKS_2D[fn.__name__] = fn
    return fn


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_close(got, want, what):
    got, want = full(got), full(want)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=ATOL, rtol=1e-5), f"{what}: max diff {(got - want).abs().max()}"


def loop(fn, init, xs, stacked=True):
    carry, ys = init, []
    for i in range(xs.shape[0]):  # xs[i]: a DTensor has no unbind
        carry, y = fn(carry, xs[i])
        ys.append(y)
    return carry, torch.stack(ys) if stacked else ys


def compiled_scan(backend="aot_eager"):
    return torch.compile(lambda f, c, xs: scan(f, c, xs), backend=backend, fullgraph=True)


def recording_backend():
    """aot_eager that keeps the forward and backward graphs."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"fw": [], "bw": []}
    backend = aot_autograd(fw_compiler=lambda gm, _: graphs["fw"].append(gm) or gm.forward,
                           bw_compiler=lambda gm, _: graphs["bw"].append(gm) or gm.forward)
    return graphs, backend


def scan_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]


def body_ops(gm, node):
    return {str(t) for t in body_targets(gm, node)}


def body_targets(gm, node):
    body = getattr(gm, node.args[0].target)
    return [n.target for n in body.graph.nodes if n.op == "call_function"]


# ---------------------------------------------------------------- DTensor bodies

def _tp_mlp():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    return parallelize_module(mlp, MESH[0], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _tp_run(run, mlp, h0, xs):
    def body(h, x):
        h = torch.tanh(mlp(h + x))
        return h, h.sum(-1)

    mlp.zero_grad(set_to_none=True)
    h0.grad = None
    c, ys = run(body, h0, xs)
    (c.sum() + (ys * ys).sum()).backward()
    return [c, ys, h0.grad, *(p.grad for p in mlp.parameters())]


def _check_tp(run):
    mlp = _tp_mlp()
    torch.manual_seed(1)
    xs, h0 = torch.randn(5, 3, 8), torch.randn(3, 8, requires_grad=True)
    want = _tp_run(loop, mlp, h0, xs)
    got = _tp_run(run, mlp, h0, xs)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"output/gradient {i}")
    assert all(isinstance(p.grad, DTensor) for p in mlp.parameters())


@check
def tensor_parallel_mlp_eager():
    _check_tp(scan)


@check
def tensor_parallel_mlp_compiled():
    graphs, backend = recording_backend()
    _check_tp(compiled_scan(backend))
    (fw,), (bw,) = graphs["fw"], graphs["bw"]
    (node,) = scan_nodes(fw)  # one scan: the loop stays rolled, the collectives are in its body
    assert "_c10d_functional.all_reduce.default" in body_ops(fw, node), body_ops(fw, node)
    (bnode,) = scan_nodes(bw)
    assert any("_c10d_functional" in op for op in body_ops(bw, bnode))


def _carry_case(run, body_kind):
    mesh = MESH[0]
    torch.manual_seed(2)
    w = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()]).requires_grad_()
    xs = distribute_tensor(torch.randn(5, 4, 6), mesh, [Shard(1)]).requires_grad_()
    c0 = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]).requires_grad_()

    def body(c, x):
        new = torch.tanh(c * w + x)
        if body_kind == "replicate":  # other placements than init's: the next step sees them redistributed
            new = new.redistribute(mesh, [Replicate()])
        return new, new.sum(-1)  # a Shard(0) y per step: Shard(1) stacked

    for t in (w, xs, c0):
        t.grad = None
    # torch 2.9's DTensor backward of torch.stack and of .sum() returns wrongly shaped gradients:
    # the reference loop keeps neither on the tape
    if run is loop:
        c, ys = loop(body, c0, xs, stacked=False)
        (c.full_tensor().sum() * 2 + sum(y.full_tensor().sum() for y in ys)).backward()
        with torch.no_grad():
            ys = torch.stack(ys)
    else:
        c, ys = run(body, c0, xs)
        (c.full_tensor().sum() * 2 + ys.full_tensor().sum()).backward()
    return [c, ys, c0.grad, xs.grad, w.grad]


@check
def dtensor_carry():
    for kind in ("same", "replicate"):
        want = _carry_case(loop, kind)
        for how, run in (("eager", scan), ("compiled", compiled_scan())):
            got = _carry_case(run, kind)
            for i, (g, w) in enumerate(zip(got, want)):
                assert_close(g, w, f"{kind}, {how}: output/gradient {i}")
        assert got[0].placements == (Shard(0),), got[0].placements  # init's layout
        y_placements = (Shard(1),) if kind == "same" else (Replicate(),)  # each step's, dim shifted by the stack
        assert isinstance(got[1], DTensor) and got[1].placements == y_placements, got[1].placements
    c0, xs = distribute_tensor(torch.randn(4, 6), MESH[0], [Shard(0)]), torch.randn(3, 4, 6)

    def partial_y(c, x):  # forward only: DTensor's own backward of a stack of Partial values fails in the loop
        return c + 1, c.sum(0)

    want = loop(partial_y, c0, xs)
    for run in (scan, compiled_scan()):
        got = run(partial_y, c0, xs)
        assert got[1].placements == (Partial(),), got[1].placements
        assert_close(got[0], want[0], "carry")
        assert_close(got[1], want[1], "Partial ys")


def _partial_ys_grads(run):
    """tanh RNN over Shard(1) DTensors whose y (a sum over the sharded dim) is Partial: the
    gradients of the weight, init and xs through the carry and the Partial ys. ``run`` None:
    the loop, its ys summed one by one (DTensor's own backward of a stack of Partial values
    fails for lengths above 1)."""
    gen = torch.Generator().manual_seed(29)
    w = distribute_tensor(torch.randn(4, 4, generator=gen) * 0.5, MESH[0], [Shard(1)]).requires_grad_()
    c0 = distribute_tensor(torch.randn(3, 4, generator=gen), MESH[0], [Shard(1)]).requires_grad_()
    xs = distribute_tensor(torch.randn(5, 3, 4, generator=gen), MESH[0], [Shard(2)]).requires_grad_()

    def body(c, x):
        h = torch.tanh(c @ w + x)
        return h, (2 * h).sum(-1)

    if run is None:
        c, loss = c0, 0
        for i in range(xs.shape[0]):
            c, y = body(c, xs[i])
            loss = loss + full(y).pow(2).sum()
        loss = loss + full(c).square().sum()
    else:
        c, ys = run(body, c0, xs)
        assert ys.placements == (Partial(),), ys.placements
        loss = full(c).square().sum() + full(ys).pow(2).sum()
    loss.backward()
    return [loss, w.grad, c0.grad, xs.grad]


@check
def dtensor_partial_ys_gradients():
    """A Partial y's local piece gets the whole gradient back (as the loop's stack would give
    it); counted as a Partial piece again it was summed over the ranks: gradients 2x the loop's
    through the ys, eager and compiled (found by a random DTensor program)."""
    want = _partial_ys_grads(None)
    for how, run in (("eager", scan), ("compiled", compiled_scan()), ("inductor", compiled_scan("inductor"))):
        for i, (g, w) in enumerate(zip(_partial_ys_grads(run), want)):
            assert_close(g, w, f"{how}: loss/gradient {i}")


def _fuzz_seeds(start, count):
    """The seeds a random check runs: ``count`` from ``start``, or by hand those
    SCAN_DIST_FUZZ_START / SCAN_DIST_FUZZ_CASES name."""
    start = int(os.environ.get("SCAN_DIST_FUZZ_START", start))
    return range(start, start + int(os.environ.get("SCAN_DIST_FUZZ_CASES", count)))


def _fuzz_inductor():
    """Do random checks draw inductor too (by hand, SCAN_DIST_FUZZ_INDUCTOR=1: seconds of compile per case)?"""
    return os.environ.get("SCAN_DIST_FUZZ_INDUCTOR") == "1"


def _compiled(f, dynamic, backend):
    return torch.compile(f, backend=backend, dynamic=dynamic)


@check
def dtensor_random_programs():
    """Random DTensor scans (placements, uneven shapes, Partial ys, reverse, remat, eager,
    aot_eager with static and dynamic shapes) against the loop, values and gradients (``_dtensor_random``)."""
    import _dtensor_random

    for seed in _fuzz_seeds(500, 12):
        _dtensor_random.run_case(seed, MESH[0], _compiled)


@check
def dtensor_random_bodies():
    """Random DTensor bodies (pytree carries and xs, a closure used twice, a bias, pytree ys,
    unroll) against the loop, values and gradients (``_dtensor_random.run_program_case``)."""
    import _dtensor_random

    ran = collections.Counter(_dtensor_random.run_program_case(seed, MESH[0], _compiled, _fuzz_inductor())
                              for seed in _fuzz_seeds(800, 8))
    print("dtensor_random_bodies:", dict(ran), flush=True)


@check
def dtensor_min_cut_uneven_shards():
    """remat="min_cut", compiled, over unevenly sharded DTensors (batch 3 and a length-1 xs on 2
    ranks): functorch's min-cut weighs local sizes, so the ranks cut the body differently, and
    one rank's backward gathered a closure again where the other's did not: gloo aborted the
    process ("Received data size doesn't match expected size"). Found by a random body
    (``dtensor_random_bodies``, seed 1072); a body with collectives is now partitioned as
    save_all is (``remat/partition._min_cut_partition``)."""
    import _dtensor_random

    for mode in ("aot_eager", "inductor"):
        _dtensor_random.run_program_case(1072, MESH[0], _compiled, mode=mode)


@check
def sharded_layers_random():
    """Random layer stacks (MLPs with or without biases, norms, residuals; depth 1-3), sharded by
    FSDP2 or tensor parallel, eager and compiled: scan_layers against the loop over an identically
    sharded copy, two SGD steps (``_layers_random``)."""
    import _layers_random

    ran = collections.Counter(_layers_random.run_layers_case(seed, MESH[0], dist.get_rank(), _fuzz_inductor())
                              for seed in _fuzz_seeds(300, 6))
    print("sharded_layers_random:", dict(ran), flush=True)


@check
def dtensor_dynamic_shapes():
    """Compiled scans over DTensors whose sizes change between calls: the default automatic
    dynamic shapes (a second graph with symbolic sizes after a shape changed) and
    dynamic=True, against the loop on plain tensors, values and gradients, with the hidden
    dim sharded and the batch changing (a Partial y where the carry is sharded along the
    summed dim); dynamic=True with the sharded dims marked static (Dynamo then reads a
    placement's dim as a symbolic int). A dynamic size along a sharded dim is a ScanError on
    every rank: uneven shards there gave the ranks different backward graphs, a deadlock."""
    # Each case compiles a DTensor scan's forward and backward once or twice (10-25 s each on 2 cores):
    # the default partition is seen under aot_eager, inductor's min-cut under inductor.
    cases = (  # backend, dynamic, carry placement, xs placement, (length, batch) per call, sharded dims static
        ("inductor", None, Shard(1), Shard(2), ((3, 4), (3, 5), (2, 9)), False),
        ("aot_eager", True, Replicate(), Replicate(), ((4, 4), (6, 6), (8, 9)), False),  # the length too
        ("aot_eager", True, Shard(1), Shard(2), ((3, 4), (4, 6)), True),
    )
    for backend, dynamic, c_place, x_place, sizes, static_sharded in cases:
        torch._dynamo.reset()
        run = torch.compile(lambda f, c, xs: scan(f, c, xs), backend=backend, dynamic=dynamic, fullgraph=True)
        for length, batch in sizes:
            what = f"{backend} dynamic={dynamic} {c_place} {x_place} length {length} batch {batch}"
            g = torch.Generator().manual_seed(length * 100 + batch)
            w, c = torch.randn(4, 4, generator=g), torch.randn(batch, 4, generator=g)
            xs = torch.randn(length, batch, 4, generator=g)
            leaves = [distribute_tensor(t, MESH[0], [p]) for t, p in ((w, Replicate()), (c, c_place), (xs, x_place))]
            for t in leaves if static_sharded else ():
                for d in [p.dim for p in t.placements if isinstance(p, Shard)]:
                    torch._dynamo.mark_static(t, d)
            got = _dynamic_shapes_step(run, leaves)
            want = _dynamic_shapes_step(loop, [w, c, xs])
            for i, (a, b) in enumerate(zip(got, want)):
                assert_close(a, b, f"{what}: {('carry', 'ys', 'grad w', 'grad init', 'grad xs')[i]}")
    torch._dynamo.reset()
    run = torch.compile(lambda f, c, xs: scan(f, c, xs), backend="aot_eager", dynamic=True, fullgraph=True)
    try:
        _dynamic_shapes_step(run, [distribute_tensor(torch.randn(*s), MESH[0], [p]) for s, p in
                                   (((4, 4), Replicate()), ((3, 4), Shard(0)), ((3, 3, 4), Replicate()))])
    except ScanError as e:
        assert "init leaf 0" in str(e) and "sharded along" in str(e) and "dynamic=False" in str(e), str(e)
    else:
        raise AssertionError("no ScanError for a dynamic size along a sharded dim")


def _dynamic_shapes_step(run, leaves):
    w, c, xs = [t.requires_grad_() for t in leaves]
    carry, ys = run(lambda c, x: (torch.tanh(c @ w + x), (c * c).sum(-1)), c, xs)
    (full(carry).sum() + full(ys).pow(2).sum()).backward()
    return [full(carry).detach(), full(ys).detach(), full(w.grad), full(c.grad), full(xs.grad)]


@check
def dtensor_xs_sharded_along_scanned_dim():
    mesh = MESH[0]
    xs = distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)])
    c0 = torch.zeros(3)

    def body(c, x):
        c = c + x.full_tensor()
        return c, c * 2

    for run in (scan, compiled_scan()):
        got, want = run(body, c0, xs), loop(body, c0, xs)
        assert_close(got[0], want[0], "carry")
        assert_close(got[1], want[1], "ys")


@check
def dtensor_carry_becoming_a_tensor_is_a_scan_error():
    c0 = distribute_tensor(torch.zeros(4, 3), MESH[0], [Shard(0)])

    def body(c, x):
        return c.full_tensor() + x, x  # a DTensor carry comes back a torch.Tensor

    for run in (scan, compiled_scan()):
        try:
            run(body, c0, torch.ones(5, 4, 3))
        except ScanError as e:
            assert "carry leaf" in str(e) and "DTensor in init" in str(e), str(e)
        else:
            raise AssertionError("no ScanError")


# ---------------------------------------------------------------- FSDP2 + scan_layers

class Layer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))


class Model(torch.nn.Module):
    def __init__(self, d=8, depth=3, scanned=True):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(d) for _ in range(depth)])
        self.head = torch.nn.Linear(d, 1)
        self.scanned = scanned

    def forward(self, x):
        if self.scanned:
            h = scan_layers(self.layers, x)
        else:
            h = x
            for layer in self.layers:
                h = layer(h)
        return self.head(h).square().mean()


def shard(module, **kwargs):
    """fully_shard on the checks' CPU mesh: without ``mesh=`` FSDP2 builds its default mesh, a
    CUDA one wherever a GPU is visible, and moves the parameters there; gloo collectives on
    those CUDA tensors then kill the process (torch 2.11 on a GPU machine)."""
    return fully_shard(module, mesh=MESH[0], **kwargs)


def sharded(model, per_layer=True, **kwargs):
    if per_layer:
        for layer in model.layers:
            shard(layer, **kwargs)
    return shard(model, **kwargs)


def sharded_2d(model, per_layer=True):
    """FSDP2 + tensor parallel, as a 2-D trainer shards: each layer's MLP parallelized over
    "tp", then fully_shard over "dp" (the layers', then the root's)."""
    mesh = MESH[1]
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _data_rank():
    """Ranks of one tensor-parallel group see the same data; data-parallel ranks their own."""
    return MESH[1].get_coordinate()[0] if len(MESH) > 1 else dist.get_rank()


def _train_like_loop(compiled, per_layer, steps=3, d=8, shard_model=sharded):
    torch.manual_seed(0)
    base = Model(d, scanned=False)
    ref = shard_model(copy.deepcopy(base), per_layer)
    model = copy.deepcopy(base)
    model.scanned = True
    model = shard_model(model, per_layer)
    graphs, backend = recording_backend()
    run = torch.compile(model, backend=backend) if compiled else model
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    torch.manual_seed(10 + _data_rank())  # each rank its own data, as in data parallel
    for step in range(steps):
        x = torch.randn(4, d)
        want, got = ref(x), run(x)
        want.backward()
        got.backward()
        assert_close(got, want, f"step {step} loss")
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            assert isinstance(q.grad, DTensor) and q.grad.placements == p.grad.placements, (name, q.grad)
            assert_close(q.grad, p.grad, f"step {step} grad of {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_close(q, p, f"{name} after {steps} steps")
    return graphs


@check
def fsdp_scan_layers_eager():
    _train_like_loop(False, per_layer=True)


@check
def fsdp_scan_layers_compiled():
    graphs = _train_like_loop(True, per_layer=True)
    fw = [gm for gm in graphs["fw"] if scan_nodes(gm)]
    bw = [gm for gm in graphs["bw"] if scan_nodes(gm)]
    assert len(fw) == 1 and len(bw) == 1, (len(graphs["fw"]), len(graphs["bw"]))  # compiled once
    (node,) = scan_nodes(fw[0])  # one scan over the 3 layers
    assert "_c10d_functional.all_gather_into_tensor.default" in body_ops(fw[0], node)
    (bnode,) = scan_nodes(bw[0])
    ops = body_ops(bw[0], bnode)
    assert "_c10d_functional.reduce_scatter_tensor.default" in ops  # gradients sharded per step
    assert "_c10d_functional.all_gather_into_tensor.default" in ops  # re-gathered, not saved
    saved = [n.meta["val"] for n in fw[0].graph.nodes if n.op == "call_function"
             and n.target.__name__ == "getitem" and n.args[0] is node][1:]  # after the final carry
    # per step: activations (4x8, 4x16) only, no gathered weight (fc1's 16x8 and up; shards are 8x8)
    assert all(v.numel() // v.shape[0] < 16 * 8 for v in saved), [tuple(v.shape) for v in saved]
    gathers = [t for t in body_targets(fw[0], node) if str(t).endswith("all_gather_into_tensor.default")]
    assert len(gathers) == 1, gathers  # the layer's 4 parameters in one all-gather, as FSDP2 does


@check
def fsdp_root_only_compiled():
    _train_like_loop(True, per_layer=False, steps=2)


@check
def fsdp_uneven_shards_compiled():
    _train_like_loop(True, per_layer=True, steps=2, d=5)  # fc2's 5 rows: 3 on rank 0, 2 on rank 1


@check_2d
def fsdp_tensor_parallel_scan_layers_eager():
    _train_like_loop(False, per_layer=True, steps=2, shard_model=sharded_2d)


@check_2d
def fsdp_tensor_parallel_scan_layers_compiled():
    """FSDP2 + TP traced: each step gathers its layer along "dp" only (FSDP2 lays the weights out
    on (dp, tp), fc1's as a _StridedShard), into the tensor-parallel DTensors the view's TP hooks
    expect; gradients reduce-scattered back along "dp", each layer's .grad in its own layout."""
    graphs = _train_like_loop(True, per_layer=True, steps=2, shard_model=sharded_2d)
    fw = [gm for gm in graphs["fw"] if scan_nodes(gm)]
    bw = [gm for gm in graphs["bw"] if scan_nodes(gm)]
    assert len(fw) == 1 and len(bw) == 1, (len(graphs["fw"]), len(graphs["bw"]))
    (node,) = scan_nodes(fw[0])
    body = getattr(fw[0], node.args[0].target)
    gathers = [n for n in body.graph.nodes if str(n.target).endswith("all_gather_into_tensor.default")]
    assert len(gathers) == 1 and gathers[0].args[1] == 2, [n.args[1:] for n in gathers]  # one, over dp's 2
    assert "_c10d_functional.all_reduce.default" in body_ops(fw[0], node)  # fc2's output, over tp
    (bnode,) = scan_nodes(bw[0])
    assert "_c10d_functional.reduce_scatter_tensor.default" in body_ops(bw[0], bnode)


@check_2d
def fsdp_tensor_parallel_layers_random():
    """``sharded_layers_random`` on the (dp, tp) mesh: tensor parallel over "tp", then FSDP2 over "dp"."""
    import _layers_random

    ran = collections.Counter(_layers_random.run_layers_case(seed, MESH[1], _data_rank(), _fuzz_inductor())
                              for seed in _fuzz_seeds(400, 3))
    print("fsdp_tensor_parallel_layers_random:", dict(ran), flush=True)


@check_2d
def fsdp_tensor_parallel_uneven_shards_compiled():
    _train_like_loop(True, per_layer=True, steps=2, d=5, shard_model=sharded_2d)  # TP-local 5 rows: 3 + 2


@check_2d
def hf_layers_fsdp_tensor_parallel():
    """Hugging Face Llama layers under tensor parallel over "tp" and FSDP2 over "dp", compiled:
    scan_layers against the model's own loop over an identically sharded copy (``_hf_sharded``)."""
    _hf_sharded_module().run_case("llama_tp", "fsdp+tp", "aot_eager", MESH[1], _compiled)


def _tp_layers(depth=3, d=8):
    """Layers each parallelized as a tensor-parallel MLP (``parallelize_module`` puts layout
    hooks on fc1 and fc2: inputs made DTensors, outputs made local again)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer(d) for _ in range(depth))
    for layer in layers:
        parallelize_module(layer, MESH[0], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return layers


def _tp_layers_step(run, layers, x):
    layers.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = run(layers, x)
    full(out).square().mean().backward()
    return [out, x.grad, *(p.grad for p in layers.parameters())]


def _check_tp_layers(run, steps=2):
    ref, ours = _tp_layers(), _tp_layers()
    torch.manual_seed(3)
    for step in range(steps):
        x = torch.randn(4, 8)
        want = _tp_layers_step(lambda layers, h: torch.nn.Sequential(*layers)(h), ref, x)
        got = _tp_layers_step(run, ours, x)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"step {step} output/gradient {i}")
        assert all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in ours.parameters())


@check
def tensor_parallel_scan_layers_eager():
    _check_tp_layers(scan_layers)


@check
def tensor_parallel_scan_layers_compiled():
    """Layers sharded by tensor parallelism carry its layout hooks on their Linears; traced,
    the body's view of each Linear runs them (one scan, the all-reduce inside its body)."""
    graphs, backend = recording_backend()
    _check_tp_layers(torch.compile(scan_layers, backend=backend, fullgraph=True))
    fw = [gm for gm in graphs["fw"] if scan_nodes(gm)]
    bw = [gm for gm in graphs["bw"] if scan_nodes(gm)]
    assert len(fw) == 1 and len(bw) == 1, (len(graphs["fw"]), len(graphs["bw"]))
    (node,) = scan_nodes(fw[0])
    assert "_c10d_functional.all_reduce.default" in body_ops(fw[0], node), body_ops(fw[0], node)
    (bnode,) = scan_nodes(bw[0])
    assert any("_c10d_functional" in op for op in body_ops(bw[0], bnode)), body_ops(bw[0], bnode)


@check
def tensor_parallel_scan_layers_inductor():
    """As above through inductor's loop: on torch 2.15 Dynamo lifts the process group's script
    object into the scan's inputs, which the lowered while_loop takes by closure."""
    _check_tp_layers(torch.compile(scan_layers, backend="inductor", fullgraph=True))


class NormBlock(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, h, bias):
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h)))) + bias


@check
def sequence_parallel_scan_layers_compiled():
    """Sequence parallelism: the hidden state between layers is a DTensor sharded along the
    sequence (the scan's carry), the norm runs on the shards (SequenceParallel), the Linears
    gather and scatter it, and a keyword input passes a PrepareModuleInput kwargs hook."""
    mesh, plan = MESH[0], {
        "": PrepareModuleInput(input_kwarg_layouts={"bias": Replicate()},
                               desired_input_kwarg_layouts={"bias": Replicate()}, use_local_output=False),
        "norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}

    def stack():
        torch.manual_seed(0)
        layers = torch.nn.ModuleList(NormBlock() for _ in range(3))
        for layer in layers:
            parallelize_module(layer, mesh, plan)
        return layers

    torch.manual_seed(4)
    x, bias = torch.randn(2, 4, 8), torch.randn(8)
    x = DTensor.from_local(x.chunk(dist.get_world_size(), 1)[dist.get_rank()], mesh, [Shard(1)])
    run = torch.compile(lambda layers, h: scan_layers(layers, h, bias=bias), backend="aot_eager", fullgraph=True)
    want = _tp_layers_step(lambda layers, h: _loop_layers(layers, h, bias), stack(), x)
    got = _tp_layers_step(run, stack(), x)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"output/gradient {i}")
    assert isinstance(got[0], DTensor) and got[0].placements == (Shard(1),)


def _loop_layers(layers, h, bias):
    for layer in layers:
        h = layer(h, bias=bias)
    return h


def _tp_layers_with_layer_1(plan):
    layers = torch.nn.ModuleList(Layer(8) for _ in range(3))
    for i, layer in enumerate(layers):
        own = plan if i == 1 else {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        if own is not None:
            parallelize_module(layer, MESH[0], own)
    return layers


@check
def layers_sharded_unlike_are_a_scan_error():
    """Traced, the layers' local shards are stacked: a layer sharded otherwise than layer 0 (or not
    at all) is a ScanError naming it, not a stack of mismatched shards failing inside torch."""
    for plan in (None, {"fc1": RowwiseParallel(), "fc2": ColwiseParallel()}):
        torch._dynamo.reset()
        try:
            torch.compile(scan_layers, backend="aot_eager", fullgraph=True)(_tp_layers_with_layer_1(plan),
                                                                            torch.randn(4, 8))
        except Exception as e:  # noqa: BLE001  (torch.compile raises it as its own error type)
            assert "layer 1's 'fc1.weight'" in str(e) and "sharded alike" in str(e), str(e)[:2000]
        else:
            raise AssertionError(f"no ScanError for layer 1 with {plan}")


class ScannedRNN(torch.nn.Module):
    """A recurrent model whose body calls a submodule at every step (scan, not scan_layers)."""

    def __init__(self, scanned=True):
        super().__init__()
        self.cell, self.scanned = torch.nn.Linear(8, 8), scanned

    def forward(self, xs):
        def body(h, x):
            h = torch.tanh(self.cell(h) + x)
            return h, h.sum(-1)

        h, ys = (scan if self.scanned else loop)(body, torch.zeros(4, 8), xs)
        return h.square().mean() + ys.square().mean()


@check
def fsdp_root_around_a_scan_compiled():
    """fully_shard on the module that calls scan: its parameters are gathered before the scan (as
    FSDP2 does for the loop), the body reads them whole; compiled, as the loop."""
    torch.manual_seed(0)
    base = ScannedRNN(scanned=False)
    ref, model = shard(copy.deepcopy(base)), copy.deepcopy(base)
    model.scanned = True
    model = shard(model)
    run = torch.compile(model, backend="aot_eager")
    torch.manual_seed(10 + dist.get_rank())
    for step in range(2):
        xs = torch.randn(5, 4, 8)
        want, got = ref(xs), run(xs)
        want.backward()
        got.backward()
        assert_close(got, want, f"step {step} loss")
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            assert_close(q.grad, p.grad, f"step {step} grad of {name}")
        for m in (ref, model):
            m.zero_grad()


@check
def fsdp_module_called_in_a_scan_body_is_a_clear_error():
    """A body calling a module sharded by fully_shard cannot be compiled (FSDP2's hooks run outside
    the graph): the ScanError says so and what to do, not only Dynamo's words for a graph break."""
    model = ScannedRNN()
    shard(model.cell)
    shard(model)
    try:
        torch.compile(model, backend="aot_eager")(torch.randn(5, 4, 8))
    except ScanError as e:
        assert "fully_shard" in str(e) and "Shard the module that calls scan" in str(e), str(e)[:3000]
    else:
        raise AssertionError("no ScanError")


class Skip(Exception):
    """A check that cannot run with what is installed: the test skips it, saying why."""


def _hf_sharded_module():
    """``_hf_sharded``, or Skip where transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise Skip("transformers is not installed") from None
    import _hf_sharded

    return _hf_sharded


def _output_capturing():
    try:
        from transformers.utils import output_capturing
    except ImportError:
        raise Skip("transformers 5 (its output-capturing hooks) is not installed") from None
    return output_capturing


class Collecting(Model):
    """A transformers 5 model's forward while asked for outputs: the collector set around the
    layers (inside the FSDP2 root's forward, whose hooks Dynamo leaves to eager); the loss also
    reads what was collected, so gradients flow through the captured outputs."""

    KEYS = ("hidden_states", "fc1")

    def forward(self, x):
        var = _output_capturing()._active_collector
        collector = {k: [] for k in self.KEYS}
        token = var.set(collector)
        try:
            loss = super().forward(x)
        finally:
            var.reset(token)
        got = [collector[k] for k in self.KEYS]
        return loss + sum(t.square().mean() for ts in got for t in ts), got


@check
def fsdp_layers_with_capture_hooks_compiled():
    """Layers holding both FSDP2's hooks and transformers 5's capture hooks (a sharded
    transformers model once asked for hidden states), told apart hook by hook: compiled, the
    gathers are done in the body and the captures recorded, so the collected outputs, loss and
    sharded gradients are the loop's."""
    oc = _output_capturing()
    torch.manual_seed(0)
    base = Collecting(scanned=False)
    for layer in base.layers:
        oc.install_output_capuring_hook(layer, "hidden_states", 0)
        oc.install_output_capuring_hook(layer.fc1, "fc1", 0)
    ref = sharded(copy.deepcopy(base))
    model = copy.deepcopy(base)
    model.scanned = True
    model = sharded(model)
    hooks = list(model.layers[0]._forward_hooks.values()) + list(model.layers[0]._forward_pre_hooks.values())
    assert {getattr(h, "__name__", "") for h in hooks} >= {"output_capturing_hook", "_pre_forward"}, hooks
    run = torch.compile(model, backend="aot_eager")
    torch.manual_seed(10 + dist.get_rank())
    for step in range(2):
        x = torch.randn(4, 8)
        (want, want_got), (got, got_got) = ref(x), run(x)
        assert_close(got, want, f"step {step} loss")
        for k, w, g in zip(Collecting.KEYS, want_got, got_got):
            assert len(g) == len(w), f"{k}: collected {len(g)} outputs, the loop {len(w)}"
            for i, (a, b) in enumerate(zip(g, w)):
                assert_close(a, b, f"step {step} {k}[{i}]")
        want.backward()
        got.backward()
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            assert isinstance(q.grad, DTensor) and q.grad.placements == p.grad.placements, (name, q.grad)
            assert_close(q.grad, p.grad, f"step {step} grad of {name}")
        for m in (ref, model):
            m.zero_grad()


@check
def hf_layers_sharded():
    """Hugging Face GPT2 and Llama layers (tiny random configs) under FSDP2, and Llama's under tensor
    parallel, eager and compiled: scan_layers against the model's own loop (``_hf_sharded``)."""
    _hf_sharded = _hf_sharded_module()

    for case in (("gpt2", "fsdp", "eager"), ("llama", "fsdp", "aot_eager"), ("llama_tp", "tp", "aot_eager")):
        torch._dynamo.reset()
        _hf_sharded.run_case(*case, MESH[0], _compiled)


@check
def hf_model_scanned_fsdp():
    """scan_model on a whole Llama causal LM sharded by FSDP2 (per layer and root), compiled with
    aot_eager: loss and full gradients against the sharded model's own loop (``_hf_sharded``)."""
    _hf_sharded = _hf_sharded_module()
    torch._dynamo.reset()
    _hf_sharded.run_model_case("llama", "aot_eager", MESH[0], recording_backend, scan_nodes)


@check
def fsdp_mixed_precision_is_a_scan_error():
    torch.manual_seed(0)
    model = sharded(Model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    try:
        torch.compile(model, backend="aot_eager")(torch.randn(2, 8))
    except Exception as e:  # noqa: BLE001
        assert "MixedPrecisionPolicy" in str(e), str(e)[:2000]
    else:
        raise AssertionError("no ScanError")


@check
def stack_layers_of_sharded_layers_is_a_scan_error():
    model = sharded(Model())
    try:
        stack_layers(model.layers)
    except ScanError as e:
        assert "DTensor" in str(e), str(e)
    else:
        raise AssertionError("no ScanError")


def _write(out, results):
    """Replace OUT.json in one step: a reader never sees half a file."""
    with open(out + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(out + ".tmp", out)


def main(rank, world, port, out):
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    MESH.append(init_device_mesh("cpu", (world,)))
    checks = CHECKS
    if os.environ.get("SCAN_DIST_SUITE") == "2d":
        MESH.append(init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")))
        checks = CHECKS_2D
    results, seconds = {}, {}
    only = os.environ.get("SCAN_DIST_CHECKS")
    for name, fn in checks.items():
        if only and name not in only.split(","):
            continue
        _write(out, {**results, "__seconds__": seconds, "__running__": name})
        torch._dynamo.reset()
        gc.collect()  # earlier checks' FSDP2 modules leave FSDP's registry now, not mid-check (a guard)
        start = time.monotonic()
        try:
            fn()
            results[name] = None
        except Skip as e:
            results[name] = {"skip": str(e)}
        except BaseException as e:  # noqa: BLE001  (reported per check; the process goes on)
            results[name] = f"{type(e).__name__}: {str(e)[:3000]}\n{traceback.format_exc()[-4000:]}"
        dist.barrier()  # the ranks stay in step whatever a check did
        seconds[name] = round(time.monotonic() - start, 1)
    _write(out, {**results, "__seconds__": seconds})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
