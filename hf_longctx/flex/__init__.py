"""Flexible sequence parallelism (FlexSP / Hydraulis): documents packed into SP groups of
several sizes per step, with equal or unequal micro-batch counts per rank -- the plan and
its runtime in one package.

Where it sits: the floor above `distributed/` (it builds its groups from `SPMesh` and
shards with `data/sharding.py`), below `ops/` and everything that patches or trains. The
group shapes it plans with are `hf_longctx/sp_groups.py` (the layout floor: `data/cost.py`
reads them too).

Planning (pure Python/NumPy, no process group, the same result on every rank): `plan.py`
the FlexPlan data structures; `packing.py` `plan_flexible`'s per-step search, packing
documents into slots of the group shapes a world can hold; `unequal.py` the variant where
ranks run different micro-batch counts. Runtime: `bank.py` the GroupBank (one aligned
SPMesh per power-of-two SP size, warmed up at init); `collator.py` per-slot shards of a
flexible step (sharing the fixed-degree collator's input validation); `step.py` a flexible
step (plan check by fingerprint, every slot's micro-batch on its group);
`unsharded_step.py` FSDP2 kept unsharded for a step whose ranks run unequal micro-batch
counts.
"""
