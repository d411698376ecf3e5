"""Random sharded layer stacks: ``scan_layers`` against the Python loop over an identically
sharded copy, for ``_distributed_checks.sharded_layers_random`` (run on every rank of the group).

Each seed draws a layer (an MLP with or without biases, GELU / tanh / SiLU, a residual or
not, a pre-LayerNorm or not), its width and depth (1-3), the input (a batch of rows or of
sequences), how the stack is sharded (FSDP2 ``fully_shard`` per layer and on the root, with
or without resharding after the forward; or tensor parallel: fc1 column-wise, fc2
row-wise; on a 2-D mesh both), the remat policy, and how it runs (eager, or compiled with aot_eager; inductor by
hand). Two SGD steps: the loss, every parameter's gradient (its placements too) and the
parameters after the steps must be the loop's.
"""
import copy
import gc
import random

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torch_scan_hop import scan_layers

_ACTIVATIONS = {"gelu": torch.nn.GELU, "tanh": torch.nn.Tanh, "silu": torch.nn.SiLU}


class _Layer(torch.nn.Module):
    def __init__(self, d, ff, bias, act, residual, norm):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d) if norm else None
        self.fc1, self.fc2 = torch.nn.Linear(d, ff, bias=bias), torch.nn.Linear(ff, d, bias=bias)
        self.act, self.residual = _ACTIVATIONS[act](), residual

    def forward(self, h):
        out = self.fc2(self.act(self.fc1(h if self.norm is None else self.norm(h))))
        return h + out if self.residual else out


class _Stack(torch.nn.Module):
    def __init__(self, layers, scanned, remat="save_all"):
        super().__init__()
        self.layers, self.scanned, self.remat = layers, scanned, remat

    def forward(self, x):
        if self.scanned:
            return scan_layers(self.layers, x, remat=self.remat)
        for layer in self.layers:
            x = layer(x)
        return x


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard(stack, how, mesh, reshard=None, plan=None):
    """``how``: "fsdp" or "tp" over a 1-D mesh, or "fsdp+tp" over a (dp, tp) one (tensor
    parallel over "tp" first, then fully_shard over "dp", as a 2-D trainer shards). ``plan``:
    each layer's tensor-parallel plan (default: this file's MLP, fc1 column-wise, fc2 row-wise);
    ``reshard``: FSDP2's ``reshard_after_forward`` (None: fully_shard's default)."""
    tp_mesh, dp_mesh = (mesh["tp"], mesh["dp"]) if how == "fsdp+tp" else (mesh, mesh)
    if how != "fsdp":
        for layer in stack.layers:
            parallelize_module(layer, tp_mesh, plan or {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if how == "tp":
        return stack
    kwargs = {} if reshard is None else {"reshard_after_forward": reshard}
    for layer in stack.layers:
        fully_shard(layer, mesh=dp_mesh, **kwargs)
    return fully_shard(stack, mesh=dp_mesh, **kwargs)


def run_layers_case(seed, mesh, data_rank, inductor=False):
    """Ours against the loop on the same sharding; raises on a difference. A 2-D ``mesh`` (dp, tp)
    shards "fsdp+tp"; ``data_rank``: which data this rank sees (its dp coordinate). ``inductor``:
    draw inductor as a mode too (seconds of compile per case). Returns what ran."""
    rng = random.Random(seed)
    d = rng.choice([4, 6, 8])
    layer_kw = dict(ff=rng.choice([d, 2 * d]), bias=rng.random() < 0.7, act=rng.choice(sorted(_ACTIVATIONS)),
                    residual=rng.random() < 0.7, norm=rng.random() < 0.4)
    depth, how, reshard = rng.choice([1, 2, 3]), rng.choice(["fsdp", "tp"]), rng.random() < 0.5
    how = "fsdp+tp" if mesh.ndim == 2 else how
    shape = rng.choice([(rng.choice([2, 3, 4]), d), (2, rng.choice([1, 3]), d)])
    mode = rng.choice(["eager", "aot_eager", "inductor"] if inductor else ["eager", "aot_eager"])
    remat = rng.choice(["save_all", "min_cut", "recompute_all"])
    case = (f"seed {seed}: {how} (reshard {reshard}), depth {depth}, d {d}, {layer_kw}, input {shape}, "
            f"remat {remat}, {mode}")
    print(case, flush=True)  # a rank that dies in a collective leaves its last case in the log
    torch._dynamo.reset()
    # the last case's FSDP2 modules leave FSDP's registry now, not mid-case: Dynamo guards on the
    # registry, and a module collected while one rank builds its guards failed that rank's compile
    # ("Error while creating guard", an IndexError) and it ran apart from the others: a hang
    gc.collect()
    torch.manual_seed(seed)
    base = torch.nn.ModuleList(_Layer(d, **layer_kw) for _ in range(depth))
    ref = shard(_Stack(copy.deepcopy(base), scanned=False), how, mesh, reshard)
    ours = shard(_Stack(copy.deepcopy(base), scanned=True, remat=remat), how, mesh, reshard)
    run = ours if mode == "eager" else torch.compile(ours, backend=mode)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    # data parallel ranks their own data; a tensor-parallel group the same input
    gen = torch.Generator().manual_seed(seed * 10 + (data_rank if how != "tp" else 0))
    try:
        for step in range(2):
            x = torch.randn(shape, generator=gen)
            want, got = full(ref(x)).square().mean(), full(run(x)).square().mean()
            want.backward()
            got.backward()
            _close(got, want, f"{case}: step {step} loss")
            for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
                assert type(q.grad) is type(p.grad), f"{case}: step {step} grad of {name}: {type(q.grad)}"
                if isinstance(p.grad, DTensor):
                    assert q.grad.placements == p.grad.placements, f"{case}: {name}: {q.grad.placements}"
                _close(q.grad, p.grad, f"{case}: step {step} grad of {name}")
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            _close(q, p, f"{case}: {name} after the steps")
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"{case}: {type(e).__name__}: {e}") from e
    return f"{how} {mode}"


def _close(got, want, what):
    got, want = full(got).detach(), full(want).detach()
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5), (
        f"{what}: {(got - want).abs().max() if got.shape == want.shape else (got.shape, want.shape)}")
