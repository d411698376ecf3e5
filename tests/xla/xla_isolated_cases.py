"""Scan bodies that once killed the process (a CHECK failure or a segfault in
torch_xla on a placeholder tensor). test_xla_inputs runs them all in ONE
subprocess (starting torch_xla costs seconds) and reports each separately:
``main`` prints a START line before and a PASS/FAIL line after each case.
"""
import sys
import traceback

import pytest
import torch
from xla_util import DEV, assert_matches_loop

from torch_scan_hop import ScanError, scan

_INIT, _XS = torch.zeros(2), torch.randn(4, 2)


def tensor_created_on_device_in_body():
    def make_body():
        return lambda c, x: (c + x * torch.tensor([1.0, 2.0], device=x.device), c.sum())
    assert_matches_loop(make_body, [], _INIT, _XS, loops=("xla", "cpu"))


def cpu_tensor_moved_to_device_in_body():
    def make_body():
        return lambda c, x: (c + x * torch.tensor([1.0, 2.0]).to(x.device), c.sum())
    assert_matches_loop(make_body, [], _INIT, _XS, loops=("xla", "cpu"))


def scalar_moved_to_cpu_in_body():
    def make_body():
        return lambda c, x: (c + x.cpu().sum(), x.sum().cpu() * 2)
    assert_matches_loop(make_body, [], _INIT, _XS, loops=("xla",))


def item_in_body_is_a_scan_error():
    with pytest.raises(ScanError, match=r"_local_scalar_dense.*\.item\(\)"):
        scan(lambda c, x: (c + x * c.sum().item(), c.sum()), torch.ones(2, device=DEV), _XS.to(DEV))


def op_without_xla_lowering_is_a_scan_error():
    with pytest.raises(ScanError, match="unfold.*no XLA lowering"):
        scan(lambda c, x: (c + x.unfold(0, 1, 1).squeeze(-1), c.sum()), torch.ones(2, device=DEV), _XS.to(DEV))


CASES = [tensor_created_on_device_in_body, cpu_tensor_moved_to_device_in_body, scalar_moved_to_cpu_in_body,
         item_in_body_is_a_scan_error, op_without_xla_lowering_is_a_scan_error]


def main():
    for case in CASES:
        print(f"START {case.__name__}", flush=True)
        try:
            case()
            print(f"PASS {case.__name__}", flush=True)
        except Exception:  # noqa: BLE001  (reported to the parent test)
            print(f"FAIL {case.__name__}\n{traceback.format_exc()}", flush=True)
    sys.stdout.flush()
