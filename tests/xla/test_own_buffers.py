"""xla/own_buffers: the Whiles' constants and fill values never share torch_xla's cached scalar buffers.

A step's program takes each distinct device buffer as one parameter; a cached scalar buffer shared
with an eager op outside the scan in one step and not in the next made XLA compile the whole step
again (Gemma 3, 12 layers: steps 1 and 2 compiled anew, 25 s each; none since).
"""
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")

from torch_scan_hop.xla import own_buffers  # noqa: E402

DEV = torch_xla.device()


def _buffers(t):
    """The device-data nodes the IR of ``t`` reads."""
    return set(torch_xla._XLAC._get_tensors_xla_device_data_node([t])[0])


def test_a_cached_scalar_is_shared_which_is_why_we_keep_our_own():
    a, b = torch.tensor(2.5, device=DEV), torch.tensor(2.5, device=DEV)
    assert _buffers(a) == _buffers(b)


def test_an_own_buffer_holds_the_value_apart_from_the_cache():
    cached = torch.tensor(2.5, device=DEV)
    own = own_buffers.OwnBuffer(cached)
    value = own.value()
    assert (own.shape, own.dtype) == ((), torch.float32)
    assert value.shape == () and value.cpu().item() == 2.5
    assert not _buffers(value) & _buffers(cached) and not _buffers(value) & _buffers(torch.tensor(2.5, device=DEV))


@pytest.mark.parametrize("dtype,value", [(torch.float32, 3), (torch.bool, 1), (torch.int64, 7)])
def test_a_filled_buffer_is_the_value_from_a_buffer_of_its_own(dtype, value):
    filled = own_buffers.filled(value, dtype, DEV, (4, 2))
    assert filled.shape == (4, 2) and filled.dtype == dtype
    assert torch.equal(filled.cpu(), torch.full((4, 2), value, dtype=dtype))
    assert not _buffers(own_buffers.filled(value, dtype, DEV, (3,))) & _buffers(torch.tensor(value, dtype=dtype, device=DEV))
