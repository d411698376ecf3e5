"""torch_xla's FSDPv2 (``SpmdFullyShardedDataParallel``) with scan, on 4 virtual CPU devices (SPMD):
scan_layers over FSDPv2-wrapped layers, and a scan body calling an FSDPv2-wrapped module. Run by
tests/distributed/test_spmd.py in the SPMD child; helpers and the mesh from spmd_cases."""
import copy
import functools

import torch
import torch_xla
from conftest import assert_trees_close, reference_scan
from spmd_cases import DEV, MESH, annotate, on_xla, spec
from xla_util import to_cpu, weighted_sum

from torch_scan_hop import ScanError, scan, scan_layers


class Plain(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.b(torch.tanh(self.a(h)))


class PlainStack(torch.nn.Module):
    def __init__(self, n, d=16):
        super().__init__()
        self.layers = torch.nn.ModuleList([Plain(d) for _ in range(n)])

    def forward(self, x):
        return scan_layers(self.layers, x, unroll=1)  # a While at any depth


def check_fsdp_v2_layers(how):
    """torch_xla's FSDPv2 (SpmdFullyShardedDataParallel) around each layer ("per_layer"), or around
    the model with an auto-wrap policy wrapping each layer ("auto_wrap"), then scan_layers over the
    wrapped layers: one While whose body annotates each layer's output as FSDPv2 does
    (functionally: its default shard_output is in place); values and gradients as the CPU loop's,
    each weight's gradient sharded like it. "own_shard_output": a shard_output of the user's
    is in place too, and cannot run in the body: a ScanError saying what to do."""
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    torch.manual_seed(4)
    n = 4
    cpu = PlainStack(n)
    stack = PlainStack(n)
    stack.load_state_dict(cpu.state_dict())
    stack = stack.to(DEV)
    if how == "auto_wrap":
        model = FSDPv2(stack, mesh=MESH, auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Plain}))
        layers = stack.layers
    else:
        own = {"shard_output": lambda out, mesh: xs.mark_sharding(out, mesh, ("fsdp", None))}
        layers = torch.nn.ModuleList([FSDPv2(layer, mesh=MESH, **(own if how == "own_shard_output" else {}))
                                      for layer in stack.layers])
        model = lambda h: scan_layers(layers, h, unroll=1)  # noqa: E731
    assert all(type(layer) is FSDPv2 for layer in layers)
    x = torch.randn(8, 16)
    xd = on_xla(x, ("fsdp", None))
    try:
        out = model(xd)
    except ScanError as e:
        assert how == "own_shard_output" and "shard_output" in str(e) and "default" in str(e), str(e)
        return
    assert how != "own_shard_output", "a shard_output of the user's ran in place in the scan body"
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert hlo.count(" while(") == 1 and 'custom_call_target="Sharding"' in hlo  # the step's output annotation
    weighted_sum(out).backward()
    cpu_x = x.clone().requires_grad_()
    want = cpu_x
    for layer in cpu.layers:
        want = layer(want)
    weighted_sum(want).backward()
    assert_trees_close(to_cpu((out, xd.grad)), (want, cpu_x.grad), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(layers.named_parameters(), cpu.layers.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5, msg=name)
        assert spec(p.grad) == spec(p) and spec(p), (name, spec(p.grad), spec(p))


def check_fsdp_v2_module_in_a_scan_body():
    """A scan body calling an FSDPv2-wrapped module: its default shard_output annotates in place,
    a ScanError that names the wrapper and the way out; that way (shard_output doing nothing,
    the body annotating functionally) then gives the loop's values and gradients."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    torch.manual_seed(5)
    cpu = torch.nn.Linear(8, 8)
    c0, xseq = torch.randn(4, 8), torch.randn(5, 4, 8)

    def body_of(cell, annotate_output):
        def body(c, x):
            h = cell(c)
            return torch.tanh((annotate(h, ("fsdp", None)) if annotate_output else h) + x), None
        return body

    cell = FSDPv2(copy.deepcopy(cpu).to(DEV), mesh=MESH)
    try:
        scan(body_of(cell, False), on_xla(c0), on_xla(xseq))
    except ScanError as e:
        assert "SpmdFullyShardedDataParallel" in str(e) and "shard_output=lambda output, mesh: None" in str(e), str(e)
    else:
        raise AssertionError("an FSDPv2 module's in-place output annotation in a scan body did not raise")
    cell = FSDPv2(copy.deepcopy(cpu).to(DEV), mesh=MESH, shard_output=lambda output, mesh: None)
    init = on_xla(c0, ("fsdp", None))
    out, _ = scan(body_of(cell, True), init, on_xla(xseq))
    weighted_sum(out).backward()
    cpu_init = c0.clone().requires_grad_()
    want, _ = reference_scan(body_of(cpu, False), cpu_init, xseq)
    weighted_sum(want).backward()
    assert_trees_close(to_cpu((out, init.grad, cell.module.weight.grad)), (want, cpu_init.grad, cpu.weight.grad),
                       atol=1e-5, rtol=1e-5)
    assert spec(cell.module.weight.grad) == spec(cell.module.weight) != ""
