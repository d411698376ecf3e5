"""Every private torch / torch_xla API this package touches, in one place.

torch's HOP internals move between releases; keeping the imports and the thin
adapters here means a new torch version changes this package, not the rules.
Nothing else in torch_scan_hop imports a private torch name
(tests/arch/test_private_names.py checks). Adapters only: an import, a function returning a
private module, class or attribute, or a thin wrapper (a call, a hook that runs the caller's
callback); the logic that decides with them (passes, patch bodies, policies) lives in the room it
serves (``inductor/workarounds.py``, ``inductor/codegen/``, ``core/trace_lock.py``, ...).
One module per subsystem:

- ``dispatch``: dispatch keys, active modes and transforms, operator and tensor internals;
- ``tracing``: make_fx / proxy mode, fake tensors, functionalization, what the body trace
  (``trace.graph``), the reads closure stand-ins (``trace.closures``) and the tracing lock
  (``core.trace_lock``) need, pytree;
- ``hop``: ``torch._ops`` / ``torch._higher_order_ops`` (schema, registry, subgraphs);
- ``autograd``: partitioners, joint node meta, compiled autograd, SAC modes, custom-op formulas;
- ``functorch``: vmap levels and batched tensors;
- ``inductor``: post-grad scan pass, pattern matcher, subgraph lowering, and inductor's modules
  and classes (``ir``, ``V``, ``config``, the wrappers' codegen, the scheduler) for the patches that
  live in ``inductor/`` (``workarounds``, ``wrapper_patches``, ``cpp_wrapper``, ``codegen``);
- ``nn``: ``nn.Module`` internals (state dicts, hooks);
- ``distributed``: FSDP2's hooks and policies (scan_layers over ``fully_shard`` layers);
- ``transformers``: Hugging Face transformers' output-capturing hooks (which of them are inert) and
  its mixture-of-experts modules (which experts implementation, what it traces to);
- ``xla``: ``torch_xla._XLAC`` and torch_xla's private ops;
- ``dynamo``: the Dynamo internals of op.dynamo's VariableTracker;
- ``unbacked``: what tracing raises or records when a function depends on tensor values;
- ``versions``: the supported torch range, as data (the dependency, messages and docs say it).

The names the package used from the former single module are re-exported
here, so ``_compat.X`` keeps working; subsystem-only adapters are reached as
``_compat.inductor.X``, ``_compat.xla.X``, ``_compat.nn.X``.
"""
from . import (  # noqa: F401
    autograd,
    dispatch,
    distributed,
    dynamo,
    functorch,
    hop,
    inductor,
    nn,
    tracing,
    transformers,
    xla,
)
from .autograd import (  # noqa: F401
    apply_unbound,
    custom_op_lacks_autograd,
    drop_checkpoint_tags,
    eager_autograd_engine,
    engine_backward,
    extract_fwd_bwd,
    leaf_grad_hooks,
    partitioner,
    rename_node,
    selective_checkpoint_modes,
)
from .dispatch import (  # noqa: F401
    AutoDispatchBelowAutograd,
    DispatchKey,
    TorchDispatchMode,
    alias_storage,
    storage_identity,
    dispatch_modes_active,
    empty_strided,
    functionalization_on,
    has_kernel_for,
    is_concrete,
    is_dynamo_compiling,
    is_exporting,
    is_op_or_packet,
    is_op_overload,
    on_xla,
    op_schema,
    storage_use_count,
    tensor_version,
)
from .functorch import (  # noqa: F401
    TransformType,
    add_batch_dim,
    below_functorch_wrappers,
    differentiating_transform_active,
    forward_ad_disabled,
    functorch_bdim,
    functorch_level,
    functorch_transforms_active,
    functorch_unwrap,
    is_batched_here,
    is_functorch_wrapped,
    is_vmap_inplace_error,
)
from .hop import (  # noqa: F401
    HigherOrderOperator,
    _from_fun,
    _maybe_run_with_interpreter,
    check_input_alias_and_mutation_return_outputs,
    dispatch_flat,
    input_mutations_and_outputs,
    install_as_upstream_scan,
    is_hop,
    materialize_as_graph,
    reenter_make_fx,
    unique_graph_id,
)
from .nn import global_module_hooks_registered  # noqa: F401
from .tracing import (  # noqa: F401
    CppFunctionalizeAPI,
    FakeTensor,
    FakeTensorMode,
    FunctionalTensor,
    ProxyTorchDispatchMode,
    allow_scalar_outputs,
    detect_fake_mode,
    disable_functional_mode,
    disable_proxy_modes_tracing,
    fresh_fake_mode,
    make_fx,
    pytree,
    tracing_context_fake_mode,
    track_tensor_tree,
    unset_fake_temporarily,
)
from .unbacked import first_value_dependent_node, is_data_dependence_error, is_zero_here  # noqa: F401
