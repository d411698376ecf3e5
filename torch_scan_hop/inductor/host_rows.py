"""Rows written by an ATen call instead of a generated kernel: per-step values whose
device inductor cannot know.

A fused attention kernel returns its RNG state (``philox_seed``, ``philox_offset``;
``rng_state`` for flash) on a device chosen at run time: the CUDA kernels return
CPU scalars unless a CUDA graph is being captured (torch's meta registrations,
"Note [Seed and Offset]"), while FakeTensorMode reports them on the query's device.
A compiled loop only hands them from the forward's attention to the backward's, so
no kernel ever reads them. A training scan saves them per step: the lowering writes
each step's value into its row of a stacked buffer, and inductor generated that
copy as a Triton kernel reading a CPU pointer: ``triton_poi_fused_copy__select_N``
failed to launch ("CUDA driver error: invalid argument", issue 39 item 2, a stack of
``nn.TransformerEncoderLayer`` trained on an H100 in float32, where SDPA picks the
memory-efficient kernel). Such rows are written by ``torch_scan_hop::host_row_copy``,
an operator inductor calls as it is (ATen's ``copy_``, any pair of devices), so the
stacked buffer stays where the fake says and the backward reads the rows as views.

Minimal reproducer (CUDA): ``torch.compile(lambda ls, h: scan_layers(ls, h))`` of
``nn.TransformerEncoderLayer(256, 4, 512, dropout=0.0, batch_first=True)`` x 2 on
``torch.randn(4, 32, 256, device="cuda", requires_grad=True)``, then ``.sum().backward()``.
"""
import operator

import torch

_RNG_OUTPUTS = {"philox_seed", "philox_offset", "rng_state", "unused"}  # "unused": flash's second RNG slot

_LIB = torch.library.Library("torch_scan_hop", "FRAGMENT")
_LIB.define("host_row_copy(Tensor(a!) buf, SymInt index, Tensor value) -> ()")


def _host_row_copy(buf, index, value):
    buf.select(0, index).copy_(value)


_LIB.impl("host_row_copy", _host_row_copy, "CompositeExplicitAutograd")


@torch.library.register_fake("torch_scan_hop::host_row_copy", lib=_LIB)
def _(buf, index, value):
    return None


def is_attention_rng_state(node):
    """Whether ``node`` is ``getitem(attention, k)`` with output ``k`` an RNG state."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return False
    producer, k = node.args
    schema = getattr(getattr(producer, "target", None), "_schema", None)
    if schema is None or "attention" not in schema.name or not isinstance(k, int) or k >= len(schema.returns):
        return False
    return schema.returns[k].name in _RNG_OUTPUTS


def host_written_ys(body, num_carry):
    """Indices of the body's ys (after its ``num_carry`` carries) to write with ``copy_row``."""
    (outs,) = body.graph.find_nodes(op="output")[0].args
    return {k for k, y in enumerate(outs[num_carry:]) if is_attention_rng_state(y)}


def copy_row(buf, index, value):
    """``buf[index] = value`` by an ATen call: the devices are whatever they are at run time."""
    torch.ops.torch_scan_hop.host_row_copy(buf, index, value)
