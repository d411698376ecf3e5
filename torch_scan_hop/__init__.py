"""torch_scan_hop: a scan HigherOrderOperator for eager, torch.compile, export and XLA.

Importing the package installs ``scan_op`` as ``torch.ops.higher_order.scan``.

The folders are the architecture, each importing only the ones below it:

    models/                        whole models: scan_model (a transformers model's layers as scans)
    api.py, fwd_bwd.py, layers/    front ends: scan, fwd_bwd, scan_layers / stack_layers
    op/                            the HigherOrderOperator and one module per dispatch rule
    trace/  xla/  inductor/        tracing and partitioning; XLA While lowering; inductor lowering
    remat/                         what a step keeps for its backward: policies, eager engine, partitioning
    core/                          pytrees and input errors, the loop schedule, the op's arguments
    _compat/                       every private torch / torch_xla API, importing nothing of ours

(tests/arch/test_imports.py keeps it so: no import cycles, no import up a floor.)
"""
from . import _compat
from .api import clear_cache, scan
from .remat.policies import (
    RematPolicy,
    checkpoint_name,
    dots_saveable,
    save_only_these_names,
)
from .core.trees import ScanError
from .fwd_bwd import fwd_bwd
from .inductor import workarounds
from .inductor.buffer_pool import empty_cache
from .layers import intact, trace_time
from .layers.scan_layers import scan_layers
from .layers.storage import stack_layers
from .models import scan_model
from .op import dynamo as _dynamo_rule
from .op.hop import scan_op
from .trace.partition import FwdBwd

_compat.install_as_upstream_scan(scan_op)
_dynamo_rule.install()
intact.install()
trace_time.install()
workarounds.fake_float64_attention_logsumexp_as_float64()

__all__ = ["scan", "scan_layers", "stack_layers", "scan_model", "scan_op", "fwd_bwd", "ScanError", "FwdBwd", "clear_cache", "empty_cache",
           "RematPolicy", "checkpoint_name", "dots_saveable", "save_only_these_names"]
