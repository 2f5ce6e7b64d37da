"""State passing between the pieces of a document spread over an SP group: one segmented scan.

Where it sits: between a linear mixer's per-piece core (`gdn_state.py`, `mamba2_state.py`)
and its output correction. Each rank has summarised each of its runs (`SequenceLayout.runs`)
as the affine map X ↦ A·X + B of the state entering it; this module composes the maps of
each document's earlier runs in GLOBAL order (a Hillis–Steele scan, ⌈log2 L⌉ rounds of
`all_to_all_single`, then one shift) and hands every run its true incoming state.
Guarantees: no state crosses a document boundary; one autograd Function whose backward is
the same scan in reverse order over the transposed maps, so every rank issues the same
collectives; the plan is pure Python from the layout, equal on every rank (invariant 8).
Bytes and the adjoint: docs/DESIGN.md "State passing for linear recurrences"."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hf_longctx.devices import upload
from hf_longctx.ops.mixers.exchange import exchange_pieces
from hf_longctx.ops.mixers.layout import SequenceLayout


@dataclass(frozen=True)
class Step:
    """One exchange of a scan, seen by every SP rank p: `send[p]` local runs whose current
    map goes out, grouped by destination rank (`send_counts[p][q]` of them to rank q);
    `target[p]` local runs that combine what arrives, grouped by source rank
    (`recv_counts[p][q]` from rank q)."""

    send: tuple
    send_counts: tuple
    target: tuple
    recv_counts: tuple


@dataclass(frozen=True)
class ScanPlan:
    """The rounds of the segmented scan and the final shift, in one chain order."""

    rounds: tuple  # (Step, ...): round k combines each run with the run 2^k places earlier in its chain
    shift: Step  # the last B of each run to the next run of its chain
    _device: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def empty(self) -> bool:
        """No chain anywhere (every document on one run): no rank sends, so no collective runs."""
        return not self.rounds and not any(sum(c) for c in self.shift.send_counts)

    def on(self, device: torch.device, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(send, target) index tensors of `rank` on `device` per step (rounds, then shift), uploaded once."""
        key = (str(device), rank)
        if key not in self._device:
            self._device[key] = [(upload(s.send[rank], device), upload(s.target[rank], device)) for s in (*self.rounds, self.shift)]
        return self._device[key]


def _step(pairs: Sequence[tuple[tuple[int, int], tuple[int, int]]], sp: int) -> Step:
    """pairs: ((src rank, src local run), (dst rank, dst local run)), in one global order."""
    send = [[[] for _ in range(sp)] for _ in range(sp)]
    recv = [[[] for _ in range(sp)] for _ in range(sp)]
    for (p, i), (q, j) in pairs:
        send[p][q].append(i)
        recv[q][p].append(j)
    as_tensor = lambda rows: torch.tensor([i for row in rows for i in row], dtype=torch.long)  # noqa: E731
    return Step(
        tuple(as_tensor(send[p]) for p in range(sp)), tuple(tuple(len(r) for r in send[p]) for p in range(sp)),
        tuple(as_tensor(recv[p]) for p in range(sp)), tuple(tuple(len(r) for r in recv[p]) for p in range(sp)),
    )


def build_scan(chains: Sequence[Sequence[tuple[int, int]]], sp: int) -> ScanPlan:
    """The scan over `chains` (each a document's runs as (owner rank, local run index), in the
    order the state flows). Every run but a chain's last passes its map on; every run but
    its first receives an incoming state."""
    longest = max((len(c) - 1 for c in chains), default=0)  # maps per chain
    rounds, d = [], 1
    while d < longest:
        rounds.append(_step([(c[j - d], c[j]) for c in chains for j in range(d, len(c) - 1)], sp))
        d *= 2
    shift = _step([(c[j], c[j + 1]) for c in chains for j in range(len(c) - 1)], sp)
    return ScanPlan(tuple(rounds), shift)


@dataclass(frozen=True)
class ChainPlan:
    """Forward (global order) and reverse (adjoint) scans of one layout, and per rank which
    local runs start their document and which pass their state on."""

    forward: ScanPlan
    reverse: ScanPlan
    starts: tuple  # starts[p][i]: local run i of rank p starts its document (its incoming state is zero)
    continues: tuple  # continues[p][i]: the document goes on after local run i (its final state is passed on)

    @staticmethod
    def of(lay: SequenceLayout) -> "ChainPlan":
        """Cached on the layout (one per micro-batch, shared by every layer)."""
        plan = lay._plans.get("chain")
        if plan is None:
            plan = lay._plans["chain"] = ChainPlan._build(lay)
        return plan

    def sends(self, rank: int) -> dict:
        """What `rank` sends to OTHER ranks in the forward scan ("maps", "states") and in the
        backward's reverse scan ("back_maps", "back_states"): maps (A and X) in all rounds but the
        last, lone states (X) in the last round and the shift; and the number of rounds (the
        same both ways; -1 when no chain exists). `ops/mixers/cost.state_traffic` prices them."""
        def counted(scan: ScanPlan) -> tuple[int, int]:
            other = lambda step: sum(c for q, c in enumerate(step.send_counts[rank]) if q != rank)  # noqa: E731
            maps = sum(other(st) for st in scan.rounds[:-1])
            return maps, other(scan.shift) + (other(scan.rounds[-1]) if scan.rounds else 0)

        (maps, states), (back_maps, back_states) = counted(self.forward), counted(self.reverse)
        return {"maps": maps, "states": states, "back_maps": back_maps, "back_states": back_states,
                "rounds": len(self.forward.rounds) if not self.forward.empty else -1}

    @staticmethod
    def _build(lay: SequenceLayout) -> "ChainPlan":
        ordered = sorted((r.start, p, i) for p, runs in enumerate(lay.runs) for i, r in enumerate(runs))
        cu = set(lay.cu_seqlens)
        chains, chain = [], []
        for start, p, i in ordered:  # runs tile [0, S) in global order
            if start in cu and chain:
                chains.append(chain)
                chain = []
            chain.append((p, i))
        chains.append(chain)
        chains = [c for c in chains if len(c) > 1]
        starts = [[r.start in cu for r in runs] for runs in lay.runs]
        continues = [[(r.start + r.length) not in cu for r in runs] for runs in lay.runs]
        return ChainPlan(build_scan(chains, lay.sp), build_scan([c[::-1] for c in chains], lay.sp),
                         tuple(map(tuple, starts)), tuple(map(tuple, continues)))


@dataclass(frozen=True)
class MapKind:
    """How a run's map acts: `mul(A, X)` applies A to a state (or composes two A's);
    `transpose(A)` is the adjoint's A; `grad_a(Λ, X)` = ∂⟨Λ, A·X⟩/∂A."""

    mul: Callable
    transpose: Callable
    grad_a: Callable


MATRIX = MapKind(  # A [.., K, K] acting on X [.., K, V] (the delta rule)
    mul=torch.matmul, transpose=lambda a: a.transpose(-1, -2), grad_a=lambda lam, x: lam @ x.transpose(-1, -2)
)
SCALAR = MapKind(  # A broadcast over X (Mamba-2: [.., 1, 1] per head; a diagonal recurrence: A shaped like X)
    mul=torch.mul, transpose=lambda a: a, grad_a=None
)


def _exclusive_scan(a: torch.Tensor, b: torch.Tensor, plan: ScanPlan, kind: MapKind, rank: int, group) -> torch.Tensor:
    """a [n, *A], b [n, *X] (maps of this rank's n local runs) → [n, *X]: the state entering
    each local run (zero where its chain starts, or where it is in no chain)."""
    n, a_shape, x_shape = a.shape[0], a.shape[1:], b.shape[1:]
    if plan.empty:  # the same answer on every rank: nobody calls the collective
        return b.new_zeros(n, *x_shape)
    a_size, x_size = a_shape.numel(), x_shape.numel()
    steps = plan.on(b.device, rank)
    for k, (step, (send, target)) in enumerate(zip(plan.rounds, steps)):
        last = k == len(plan.rounds) - 1  # the last round's A products are never read again
        item = x_size if last else a_size + x_size
        out = b.index_select(0, send).reshape(-1, x_size)  # [n_send, |X|]
        if not last:
            out = torch.cat([a.index_select(0, send).reshape(-1, a_size), out], dim=1)  # [n_send, |A| + |X|]
        got = torch.cat(exchange_pieces(out.split(list(step.send_counts[rank])), [(c, item) for c in step.recv_counts[rank]], group))
        ta = a.index_select(0, target)  # [n_recv, *A]: the later run's map, applied after the received one
        gb = got[:, item - x_size:].reshape(-1, *x_shape)  # [n_recv, *X]
        b = b.index_copy(0, target, kind.mul(ta, gb) + b.index_select(0, target))
        if not last:
            a = a.index_copy(0, target, kind.mul(ta, got[:, :a_size].reshape(-1, *a_shape)))
    send, target = steps[-1]
    shift = plan.shift
    out = b.index_select(0, send).reshape(-1, x_size)  # [n_send, |X|]
    got = torch.cat(exchange_pieces(out.split(list(shift.send_counts[rank])), [(c, x_size) for c in shift.recv_counts[rank]], group))
    return b.new_zeros(n, *x_shape).index_copy(0, target, got.reshape(-1, *x_shape))  # [n, *X]


def exact_precision(device: torch.device):
    """Autocast off: the maps, their compositions and the output corrections stay in their own
    dtype (fp32), as the module's recurrence keeps its state (no-op on devices without autocast)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class _StatePassing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: ChainPlan, kind: MapKind, rank: int, group, a: torch.Tensor, b: torch.Tensor):
        with torch.no_grad(), exact_precision(b.device):
            x_in = _exclusive_scan(a, b, plan.forward, kind, rank, group)
        ctx.save_for_backward(a, x_in)
        ctx.plan, ctx.kind, ctx.rank, ctx.group = plan, kind, rank, group
        return x_in

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, x_in = ctx.saved_tensors
        kind = ctx.kind
        with exact_precision(a.device):
            # Λ entering run j in reverse order = total gradient of the state AFTER run j (forward)
            lam = _exclusive_scan(kind.transpose(a), grad.to(x_in.dtype).contiguous(), ctx.plan.reverse, kind, ctx.rank,
                                  ctx.group)
            da = kind.grad_a(lam, x_in) if kind.grad_a is not None else (lam * x_in).sum_to_size(a.shape)
        return None, None, None, None, da, lam


def run_bounds(lay: SequenceLayout, rank: int) -> list[tuple[int, int]]:
    """[(lo, hi)] local rows of each local run of `rank`, in local order."""
    out, lo = [], 0
    for r in lay.runs[rank]:
        out.append((lo, lo + r.length))
        lo += r.length
    return out


def incoming_states(
    a: torch.Tensor, b: torch.Tensor, lay: SequenceLayout, kind: MapKind, rank: int, group, anchor: torch.Tensor
) -> torch.Tensor:
    """a [n_runs, *A], b [n_runs, *X] (fp32, or fp64): the zero-state map X ↦ A·X + B of each local run
    of `rank` (any value where the run starts or ends its document) → [n_runs, *X]: the
    true state entering each local run, in b's dtype. Collective over `group` (every SP rank calls it; a
    no-op without chains). `anchor`: a scalar of the layer's graph (say, one element of the
    mixer's input); the maps are tied to it so that this collective's backward runs on every
    rank before the layer's earlier collectives, even on a rank whose maps are all constant."""
    b = b + anchor.to(b.dtype) * 0
    return _StatePassing.apply(ChainPlan.of(lay), kind, rank, group, a.contiguous(), b.contiguous())
