"""Flexible sequence parallelism (FlexSP / Hydraulis): documents packed into SP groups of
several sizes per step, with equal or unequal micro-batch counts per rank.

Where it sits: the floor above `distributed/` (groups built from `SPMesh`, shards made with
`data/sharding.py`), below `ops/` and everything that patches or trains; its group shapes
are `hf_longctx/sp_groups.py`. Planning (pure, the same on every rank): `plan.py`
(FlexPlan), `packing.py` (`plan_flexible`), `unequal.py` (`plan_unequal`). Runtime:
`bank.py` (GroupBank), `collator.py` (per-slot shards), `step.py` (plan check by
fingerprint, every slot on its group), `unsharded_step.py` (FSDP2 unsharded for a step
with unequal micro-batch counts)."""
