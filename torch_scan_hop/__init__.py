"""torch_scan_hop: a scan HigherOrderOperator for eager, torch.compile, export and XLA.

Importing the package installs ``scan_op`` as ``torch.ops.higher_order.scan``.
"""
from . import _compat, _inductor_fixes
from ._op import scan_op
from . import rules  # noqa: F401  (registers every rule of scan_op)
from . import stacking_dynamo
from ._buffer_pool import empty_cache
from ._cache import clear as clear_cache
from ._trees import ScanError
from .api import scan
from .graphs import fwd_bwd
from .layers import scan_layers
from .stacking import stack_layers
from .partition import FwdBwd

_compat.install_as_upstream_scan(scan_op)
rules.rule_dynamo.install()
stacking_dynamo.install()
_inductor_fixes.fake_float64_attention_logsumexp_as_float64()

__all__ = ["scan", "scan_layers", "stack_layers", "scan_op", "fwd_bwd", "ScanError", "FwdBwd", "clear_cache", "empty_cache"]
