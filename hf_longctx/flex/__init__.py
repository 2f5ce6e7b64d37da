"""The runtime of flexible sequence parallelism: what executes a `data/flex/` plan.

Where it sits: the floor above `distributed/` (it builds its groups from `SPMesh` and
shards with `data/sharding.py`), below `ops/` and everything that patches or trains.

`bank.py` the GroupBank (one aligned SPMesh per power-of-two SP size, warmed up at init);
`collator.py` per-slot shards of a flexible step (sharing the fixed-degree collator's input
validation); `step.py` a flexible step (plan check by fingerprint, every slot's micro-batch on
its group); `unsharded_step.py` FSDP2 kept unsharded for a step whose ranks run unequal
micro-batch counts.
"""
