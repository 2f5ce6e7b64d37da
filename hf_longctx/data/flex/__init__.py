"""Flexible sequence-parallel planning (FlexSP / Hydraulis): documents packed into SP groups
of several sizes per step, with equal or unequal micro-batch counts per rank.

`plan.py` the FlexPlan data structures and `plan_flexible`'s per-step search; `packing.py`
the packing of documents into slots of the group shapes a world can hold
(`hf_longctx/sp_groups.py`); `unequal.py` the variant where ranks run different micro-batch counts. Pure Python
and torch tensors like the rest of `data/`; the runtime that executes a plan is
`flex/`.
"""
