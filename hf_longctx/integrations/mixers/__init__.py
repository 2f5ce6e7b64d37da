"""The linear mixers of hybrid models under sequence parallelism: class → adapter registry.

Where it sits: `patch()` calls `registry.plan_mixers` before it changes anything (refusals
name the numbers), `registry.apply_mixers` to replace the forward of every supported mixer
INSTANCE (restored by `unpatch()`), and, from its pre-forward hook, `MixerBinding.begin`
with the batch's `SPBatchInfo` (wrappers read the batch from the binding; no global).
Each wrapper (`wrappers.py`) keeps the module's projections, norms and parameters and
replaces only the core with an exact scheme of `ops/mixers/` (chosen by `modes.py`,
`dispatch.py`, on the batch's own group), taking document boundaries from OUR metadata,
never transformers' kwargs (its torch paths leak state across documents).
`registry.REGISTRY` lists every known mixer: adapter or refusal; `sp_handled_classes()`
feeds the structural rule's `handled`."""
