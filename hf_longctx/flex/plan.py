"""The flexible step plan: per micro-batch slot, the SP groups tiling the world and their
documents; its checks, fingerprint and modelled cost.

Where it sits: produced by `flex/packing.py` / `flex/unequal.py` on every rank from the
same document list, consumed by `flex/step.py`. Pure Python/NumPy. `validate()` is the
liveness guard under FSDP2, run when a plan is built, before any collective: with equal
calls every slot covers every rank exactly once; with unequal calls
(`flex/unsharded_step.py`) every rank follows the slot order as one total order, and each
rank's last micro-batch is the last of every member of its group ("closing").
Why these two rules prevent deadlock: docs/DESIGN.md "Decisions and why"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_longctx.data.cost import GroupCost
from hf_longctx.sp_groups import GroupShape

_FP_MOD = 2_147_483_647


@dataclass(frozen=True)
class FlexGroup:
    """One SP group of one slot: ranks [index·size, (index+1)·size), documents in order.

    Attributes:
        size: Ranks in the group.
        index: The group's place among the slot's groups of its size.
        docs: The indices of the documents it packs, in packing order.
    """

    size: int
    index: int
    docs: tuple[int, ...]

    @property
    def ranks(self) -> range:
        """The global ranks of this group: `size` consecutive ranks from `index * size`."""
        return range(self.index * self.size, (self.index + 1) * self.size)


@dataclass(frozen=True)
class FlexPlan:
    """`slots[m]`: the groups of micro-batch slot m, largest first, tiling the world.

    Made by `plan_flexible`, `plan_fixed` or `plan_unequal`; checked when built.

    Attributes:
        slots: `slots[m]`: the `FlexGroup`s of micro-batch slot m.
        lengths: The step's document lengths.
        world_size: The ranks the groups tile.
        max_tokens_per_rank: Tokens one rank holds in one micro-batch (a group of size s
            packs at most s times this).
        shapes: The group shapes the plan may use.
        strategy: The planner that made it.
        equal_calls: Every rank runs one micro-batch per slot (False: `plan_unequal`'s
            unequal counts, for a step with unsharded parameters).
    """

    slots: tuple[tuple[FlexGroup, ...], ...]
    lengths: tuple[int, ...]
    world_size: int
    max_tokens_per_rank: int
    shapes: tuple[GroupShape, ...]
    strategy: str = "flex"
    equal_calls: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_slots(self) -> int:
        """Micro-batch slots of the step (every rank runs one micro-batch per slot)."""
        return len(self.slots)

    def shape(self, size: int) -> GroupShape:
        """The Ulysses x ring shape of this plan's groups of `size` ranks."""
        for s in self.shapes:
            if s.size == size:
                return s
        raise ValueError(f"group size {size} is not one of the plan's sizes {[s.size for s in self.shapes]}")

    def layouts(self) -> list[tuple[int, ...]]:
        """Group sizes of every slot, e.g. [(4,), (2, 1, 1)]."""
        return [tuple(g.size for g in slot) for slot in self.slots]

    def for_rank(self, rank: int) -> list[FlexGroup]:
        """The groups `rank` belongs to, in slot order: one per slot with equal calls."""
        return [g for slot in self.slots for g in slot if rank in g.ranks]

    def calls(self) -> np.ndarray:
        """[world] forward/backward calls of every rank."""
        n = np.zeros(self.world_size, dtype=np.int64)
        for slot in self.slots:
            for g in slot:
                n[g.index * g.size : (g.index + 1) * g.size] += 1
        return n

    def group_tokens(self, group: FlexGroup) -> int:
        """Padded tokens of a group's micro-batch (documents to the shape's doc multiple)."""
        shape = self.shape(group.size)
        return sum(shape.padded(self.lengths[d]) for d in group.docs)

    def validate(self) -> None:
        """Every document exactly once; groups aligned, disjoint and tiling the world in every
        slot (equal call counts on every rank); capacities respected. Raises ValueError naming
        the offending slot/group -- before any collective."""
        w, n = self.world_size, len(self.lengths)
        seen = np.zeros(n, dtype=np.int64)
        for m, slot in enumerate(self.slots):
            covered = np.zeros(w, dtype=np.int64)
            for g in slot:
                shape = self.shape(g.size)
                if g.index < 0 or (g.index + 1) * g.size > w:
                    raise ValueError(f"slot {m}: group (size {g.size}, index {g.index}) lies outside the world of {w} ranks")
                covered[g.index * g.size : (g.index + 1) * g.size] += 1
                for d in g.docs:
                    if not 0 <= d < n:
                        raise ValueError(f"slot {m}: document {d} does not exist ({n} documents)")
                    seen[d] += 1
                tokens, cap = self.group_tokens(g), shape.capacity(self.max_tokens_per_rank)
                if tokens > cap:
                    raise ValueError(
                        f"slot {m}: group (size {g.size}, index {g.index}) holds {tokens} padded tokens > its capacity {cap} "
                        f"({g.size} × max_tokens_per_rank {self.max_tokens_per_rank})"
                    )
            if not self.equal_calls and (covered > 1).any():
                bad = np.flatnonzero(covered > 1)[:8].tolist()
                raise ValueError(f"slot {m}: groups {[(g.size, g.index) for g in slot]} overlap on ranks {bad}")
            if self.equal_calls and not (covered == 1).all():
                bad = np.flatnonzero(covered != 1)[:8].tolist()
                raise ValueError(
                    f"slot {m}: groups {[(g.size, g.index) for g in slot]} do not cover every rank exactly once (ranks {bad} "
                    f"are covered {covered[bad].tolist()} times): those ranks would run a different number of "
                    "forward/backward calls and FSDP's collectives would hang"
                )
        if not (seen == 1).all():
            bad = np.flatnonzero(seen != 1)[:8].tolist()
            raise ValueError(f"documents {bad} appear {seen[bad].tolist()} times in the plan (each must appear once)")
        if not self.equal_calls:
            self._validate_closing()

    def _validate_closing(self) -> None:
        """Unequal calls: every rank runs >= 1 micro-batch (its last one carries the gradient
        sync) and every rank's last micro-batch is the last of all its group's members."""
        last: list[tuple[int, int, int] | None] = [None] * self.world_size  # rank -> (slot, size, index) of its last
        for m, slot in enumerate(self.slots):
            for g in slot:
                for r in g.ranks:
                    last[r] = (m, g.size, g.index)
        idle = [r for r in range(self.world_size) if last[r] is None][:8]
        if idle:
            raise ValueError(f"ranks {idle} run no micro-batch: every rank needs one (its backward syncs the gradients)")
        for r in range(self.world_size):
            m, size, i = last[r]
            g = next(x for x in self.slots[m] if (x.size, x.index) == (size, i))
            later = [q for q in g.ranks if last[q] != last[r]]
            if later:
                raise ValueError(
                    f"rank {r} ends the step in slot {m}'s group (size {g.size}, index {g.index}) but its members {later[:8]} "
                    "run later micro-batches: the gradient reduce-scatter inside that backward would be ordered "
                    "differently against the group's collectives on its members (a hang); give those ranks a last "
                    "micro-batch of their own (plan_unequal does)"
                )

    def fingerprint(self) -> int:
        """A checksum of the whole plan; equal on every rank iff the plans agree."""
        v = (len(self.lengths) * 1_000_003 + self.world_size * 2 + int(self.equal_calls)) % _FP_MOD
        for i, n in enumerate(self.lengths):
            v = (v * 31 + n * (i % 65521 + 1)) % _FP_MOD
        for m, slot in enumerate(self.slots):
            for g in slot:
                v = (v * 131 + g.size * 7 + g.index * 13 + m) % _FP_MOD
                for d in g.docs:
                    v = (v * 37 + d + 1) % _FP_MOD
        return v

    def stats(self, cost: GroupCost) -> dict[str, Any]:
        """Modelled step, ideal, per-rank busy time max/mean.

        Equal calls: the step is Σ over slots of the slowest group (each group's micro-batch
        with its size's overhead). Unequal calls: ranks do not wait for a slot to end, only
        for their group's members, so the step is the makespan of running every micro-batch
        in slot order as soon as all its members are free. Ideal: Σ_doc min_s s·T_s / world
        plus the micro-batches the tokens need × the smallest overhead (the fewest slots with
        equal calls; their average per rank, not rounded up, with unequal calls), which no
        plan can beat."""
        lengths = np.asarray(self.lengths, dtype=np.int64)
        slot_max, busy, free = [], np.zeros(self.world_size), np.zeros(self.world_size)
        for slot in self.slots:
            loads = [self.group_cost(g, cost) for g in slot]
            slot_max.append(max(loads))
            for g, t in zip(slot, loads):
                r = slice(g.index * g.size, (g.index + 1) * g.size)
                busy[r] += t
                free[r] = free[r].max() + t
        best = np.full(len(lengths), np.inf)
        fewest = np.full(len(lengths), np.inf)  # [N] fewest padded tokens of each document
        for shape in self.shapes:
            p = shape.padded(lengths)
            ok = p <= shape.capacity(self.max_tokens_per_rank)
            best = np.where(ok, np.minimum(best, shape.size * cost(shape.size, p)), best)
            fewest = np.where(ok, np.minimum(fewest, p), fewest)
        ideal = float(best.sum()) / self.world_size if len(lengths) else 0.0
        if cost.overheads and len(lengths):
            need = fewest.sum() / (self.world_size * self.max_tokens_per_rank)
            slots = int(np.ceil(need)) if self.equal_calls else float(need)
            ideal += slots * min(cost.overhead(s.size) for s in self.shapes)
        step = float(sum(slot_max)) if self.equal_calls else float(free.max())
        calls = self.calls()
        return {
            "synced_step": step,
            "ideal_step": ideal,
            "synced_over_ideal": step / ideal if ideal > 0 else 1.0,
            "busy_max_over_mean": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
            "num_slots": self.num_slots,
            "calls": (int(calls.min()), int(calls.max())),
            "layouts": self.layouts(),
        }

    def group_cost(self, g: FlexGroup, cost: GroupCost) -> float:
        """Modelled time of group g's micro-batch (its documents padded for its shape); an
        empty group still runs its slot's (padding) micro-batch: it pays the overhead."""
        lengths = np.asarray(self.lengths, dtype=np.int64)[list(g.docs)]
        return cost.microbatch(g.size, self.shape(g.size).padded(lengths))
