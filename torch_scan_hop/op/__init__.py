"""The scan HigherOrderOperator (``hop``) and its rules, one module per dispatch rule.

Importing this package registers every rule on ``scan_op``.

=============================  ==================  ==============================================
dispatch key / mode            module              what it does
=============================  ==================  ==============================================
CompositeExplicitAutograd      ``eager``           the Python loop (``loop``), below autograd
Autograd                       ``autograd``        eager: the loop on the tape; traced: partitioned
                                                   forward scan, backward as a reverse scan
FakeTensorMode                 ``fake``            output metadata from one fake run of the body
ProxyTorchDispatchMode         ``proxy``           make_fx: ONE scan node per schedule segment
Functionalize                  ``functionalize``   functionalized body, input mutation an error
functorch (vmap, grad, jvp)    ``functorch``       vmap: one scan over the vmapped body
XLA                            ``xla``             one XLA While around the body's HLO
Dynamo (torch.compile)         ``dynamo``          VariableTracker capturing one scan node
DTensor (traced, pre-dispatch) ``dtensor``         a scan over the local tensors, the body
                                                   wrapping them back (collectives per step)
selective checkpoint modes     ``checkpoint``      traced: the scan is one op to the policy
=============================  ==================  ==============================================

May import: ``core``, ``trace``, ``xla``, ``inductor``, ``_compat``. Rules import only
``hop`` (the operator), ``loop`` (the eager loop they share), ``compile_errors`` (the
ScanErrors of a failed torch.compile capture, also raised by the front ends under Dynamo),
``carry_grads`` (the carries' requires-grad flags ``dynamo`` speculates a body with)
and the layers below, never each other (tests/arch/test_imports.py checks).
"""
from . import (
    autograd,
    checkpoint,
    dtensor,
    dynamo,
    eager,
    fake,
    functionalize,
    functorch,
    proxy,
    xla,
)
from .hop import scan_op

RULES = {
    "CompositeExplicitAutograd": eager,
    "Autograd": autograd,
    "FakeTensorMode": fake,
    "ProxyTorchDispatchMode": proxy,
    "Functionalize": functionalize,
    "functorch": functorch,
    "XLA": xla,
    "Dynamo": dynamo,
    "selective checkpoint modes": checkpoint,
    "DTensor": dtensor,
}

__all__ = ["scan_op", "RULES"]
