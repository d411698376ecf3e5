"""scan_layers with per-layer state that each layer writes (``layers.written_rows``): a toy
running-sum cache per layer, against the Python loop over the layers, eager and compiled."""
import pytest
import torch

from torch_scan_hop import scan_layers
from torch_scan_hop.layers.written_rows import WrittenRows


class Slot(WrittenRows):
    """A layer's slot: ``total`` (B, D) accumulates what the layer adds; ``target``: the list the
    slot's final row goes to."""

    selects = ("index",)

    def __init__(self, total, target=None):
        self.total, self.target, self.new = total, target, None

    def rows(self):
        return (self.total,)

    def over(self, rows):
        return Slot(*rows)

    def written(self):
        return (self.total,) if self.new is None else (self.new,)

    def add(self, value, index):  # ``index`` picks the slot in a real cache: ignored here
        self.new = self.written()[0] + value
        return self.new

    def take(self, rows):
        self.target.append(rows[0])


class Layer(torch.nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index, self.lin = index, torch.nn.Linear(4, 4)

    def forward(self, h, slot=None):
        y = torch.tanh(self.lin(h))
        return h + 0.5 * slot.add(y, self.index)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_each_layer_writes_its_own_slot(backend, fresh_dynamo):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Layer(i) for i in range(3)])
    h0, totals = torch.randn(2, 4), torch.randn(3, 2, 4)
    h, want = h0, []
    for i, layer in enumerate(layers):  # the loop: each layer its own slot
        y = torch.tanh(layer.lin(h))
        want.append(totals[i] + y)
        h = h + 0.5 * want[-1]
    got_rows = []

    def run(h0, totals):
        slots = [{"slot": Slot(totals[i], target=got_rows)} for i in range(3)]
        return scan_layers(layers, h0, layer_kwargs=slots)

    got = (run if backend is None else torch.compile(run, backend=backend, fullgraph=True))(h0, totals)
    torch.testing.assert_close(got, h)
    assert len(got_rows) == 3
    for g, w in zip(got_rows, want):
        torch.testing.assert_close(g, w)


class OtherSlot(Slot):
    """A slot of another kind, with the same rows: its update would compute something else."""

    def add(self, value, index):
        self.new = self.written()[0] - value
        return self.new


def test_slots_of_different_kinds_in_one_scan_are_refused(fresh_dynamo):
    """A scanned step remakes every layer's slot from layer 0's: a layer whose slot is of another
    class would run layer 0's update on its rows, so the traced scan refuses it (the eager loop,
    calling each layer with its own slot, runs it)."""
    from torch_scan_hop import ScanError

    layers = torch.nn.ModuleList([Layer(i) for i in range(2)])
    h0, totals = torch.randn(2, 4), torch.randn(2, 2, 4)

    def run(h0, totals):
        slots = [{"slot": kind(totals[i], target=[])} for i, kind in enumerate((Slot, OtherSlot))]
        return scan_layers(layers, h0, layer_kwargs=slots)

    run(h0, totals)  # eager: the loop
    with pytest.raises(ScanError, match="layer 1's per-layer state is \\['OtherSlot'\\], layer 0's \\['Slot'\\]"):
        torch.compile(run, backend="aot_eager", fullgraph=True)(h0, totals)
