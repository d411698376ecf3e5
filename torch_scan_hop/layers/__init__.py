"""Layer stacks: ``scan_layers`` (a stack of identical modules as ONE scan) and
``stack_layers`` (their parameters stored stacked), floor by floor:

- ``scan_layers``: the front end (imports ``api``, the eager loop and everything below);
- ``patterns``: patterned stacks (which layers are of one kind, the segments a stack splits
  into: scans over blocks of a repeating pattern, runs of one kind, single layers);
- ``blocks``: the ``LayerBlock`` a scan over blocks runs, its runs of one kind scanned nested;
- ``alike``: kinds with one weight signature as one scan choosing each layer's code by kind;
- ``one_code``: kinds told before the scan to trace to one graph (then no cond: one layer's code);
- ``layer_kwargs``: per-layer keyword inputs (shared ones closed over, differing tensors stacked);
- ``outputs``: what a layer returns (the hidden state, or a tuple of it and extras such as
  attention weights) and what ``scan_layers`` returns for it (the extras stacked);
- ``storage``: the stacked containers ``stack_layers`` returns;
- ``checks``: what a scanned stack asks of its layers (no hooks, no running-stat updates);
- ``experts``: transformers' mixture-of-experts modules in a traced scan: an experts implementation
  whose shapes depend on the routing refused by name, with the one that traces;
- ``attributes``: whether every layer's plain attributes equal layer 0's (asked per eager XLA call:
  then the body reads no peer layer);
- ``grads``: where stacked storage's gradients go (per layer or on the stacks);
- ``trace_time``: a question answered in plain Python while Dynamo traces (``one_code``'s);
- ``intact``: the per-call "layers still hold the stack's parameters" check, answered by
  Dynamo when tracing;
- ``layer_state``: each layer's parameters and buffers, checked to agree with layer 0's;
- ``fsdp``: FSDP2 (``fully_shard``) layers in a traced scan_layers: each step gathers its layer;
- ``stack_weights``: ``torch.stack`` of the weights, as a custom op under compile (an
  autograd.Function in eager calls on XLA);
- ``ownership``: which container a parameter belongs to (imports no sibling);
- ``view``: the body's read-only view of layer 0 with one step's slice of the weights;
- ``capture``: transformers 5's output-capturing hooks in a traced scan (recorded, replayed).
- ``module_state``: plain tensors a layer keeps on its modules (RecurrentGemma's decode state):
  scanned as rows, what the body assigns handed back to each layer;
- ``written_rows``: per-layer state each layer writes (a KV cache slot): scanned as rows, the
  writes returned as ys and handed back to each layer's object.

May import: ``api``, ``op``, ``trace``, ``core``, ``_compat``.
"""
