"""The linear mixers of hybrid models under sequence parallelism: class → adapter registry.

Where it sits: `patch()` (`integrations/model_patch.py`) calls `registry.plan_mixers` before
it changes anything (refusals name the numbers), `registry.apply_mixers` to replace the
forward of every supported mixer INSTANCE (an instance attribute, as `integrations/memory.py`
does; `unpatch()` restores it), and, from its model-level pre-forward hook,
`binding.MixerBinding.begin` with the batch's `SPBatchInfo`: decoder layers do not forward
arbitrary kwargs to every mixer, so the wrappers read the batch metadata from the binding
(closure, no global).

Each wrapper (`wrappers.py`) reuses the module's own projections, norms and parameters and
replaces only the sequence-mixing core by a scheme of `ops/mixers/` that is exact for packed
documents under any SP layout (zigzag ring × Ulysses, FPDT rank-ordinal chunks) -- for GDN
and Mamba-2 the head all-to-all or state passing, per `patch(mixers=...)` and the cost rule
(`modes.py`, `dispatch.py`), on the batch's own group (a GroupBank's) --, taking
document boundaries and the token permutation from OUR metadata, never from transformers'
kwargs (transformers' own torch paths ignore `cu_seqlens` and leak state across documents).

`registry.REGISTRY` is the single table of token mixers outside attention that hf_longctx
knows: an adapter (supported) or a refusal reason. `registry.sp_handled_classes()` is the hook
a deny-by-default structural rule uses to accept models whose mixers are wrapped here.
"""
