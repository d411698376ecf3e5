"""Every rule of ``scan_op``, one module each; importing this module registers them.

=============================  ======================  ==============================================
dispatch key / mode            module                  what it does
=============================  ======================  ==============================================
CompositeExplicitAutograd      ``rule_eager``          the Python loop, below autograd
Autograd                       ``rule_autograd``       eager: the loop on the tape; traced: partitioned
                                                       forward scan, backward as a reverse scan
FakeTensorMode                 ``rule_fake``           output metadata from one fake run of the body
ProxyTorchDispatchMode         ``rule_proxy``          make_fx: ONE scan node per schedule segment
Functionalize                  ``rule_functionalize``  functionalized body, input mutation an error
functorch (vmap, grad, jvp)    ``rule_functorch``      vmap: one scan over the vmapped body
XLA                            ``rule_xla``            one XLA While around the body's HLO
Dynamo (torch.compile)         ``rule_dynamo``         VariableTracker capturing one scan node
selective checkpoint modes     ``rule_checkpoint``     traced: the scan is one op to the policy
=============================  ======================  ==============================================

Rules import only shared helpers (``_body_checks``, ``eager_loop``,
``_flat_body``, ``_compat``...), never each other.
"""
from . import (  # noqa: F401  (each registers its rule on import)
    rule_autograd,
    rule_checkpoint,
    rule_dynamo,
    rule_eager,
    rule_fake,
    rule_functionalize,
    rule_functorch,
    rule_proxy,
    rule_xla,
)

RULES = {
    "CompositeExplicitAutograd": rule_eager,
    "Autograd": rule_autograd,
    "FakeTensorMode": rule_fake,
    "ProxyTorchDispatchMode": rule_proxy,
    "Functionalize": rule_functionalize,
    "functorch": rule_functorch,
    "XLA": rule_xla,
    "Dynamo": rule_dynamo,
    "selective checkpoint modes": rule_checkpoint,
}
