"""Per-document cost model T(l) = a·l² + b·l + c.

Where it sits: the first stage after the sampler: `data/packing.py` asks it how long each
document takes, so DP ranks and micro-batches are balanced by time rather than by tokens;
memory stays linear in tokens and is capped separately by the planner. `GroupCost` gives
one such model per SP-group size (with a per-document and per-micro-batch term).
Papers: Hydraulis' quadratic-plus-linear execution-time estimate; the FlexSP appendix's
profiled model fitted by least squares (within ~5 % of measured time).
`CostModel.from_config` is the analytic default in FLOPs (≈ 6·N per token for the
matmuls, plus causal attention's l²·layers·hidden)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence, overload

import numpy as np

from hf_longctx.data.model_dims import ModelDims

@dataclass(frozen=True)
class CostModel:
    """Estimated time (or FLOPs) of one document of `l` tokens: a·l² + b·l + c.

    The unit is whatever the coefficients carry: FLOPs for `from_config`, seconds for
    `fit`. Only ratios matter to the planner, so any consistent unit works.

    Args:
        a: The quadratic coefficient (attention's l² work), finite and >= 0.
        b: The linear coefficient (the work every token does), finite and >= 0.
        c: A constant per document, finite and >= 0.

    Raises:
        ValueError: A coefficient is not a finite number, or is negative.
    """

    a: float
    b: float
    c: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.floating, np.integer)) or not math.isfinite(value):
                raise ValueError(f"CostModel.{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(
                    f"CostModel.{name} = {value!r} is negative; the planner needs a cost that "
                    "never decreases with length"
                )
            object.__setattr__(self, name, float(value))

    @overload
    def __call__(self, length: int | float) -> float: ...

    @overload
    def __call__(self, length: Sequence[int] | np.ndarray) -> np.ndarray: ...

    def __call__(self, length):
        """Cost of one length (returns a float) or of many (returns a float64 array)."""
        if np.isscalar(length):
            x = float(length)
            return self.a * x * x + self.b * x + self.c
        x = np.asarray(length, dtype=np.float64)
        return (self.a * x + self.b) * x + self.c

    @classmethod
    def from_config(cls, config: Any) -> "CostModel":
        """Training FLOPs (forward + backward = 3× forward) of one document.

        Linear term b = 6·N: N counts the weights every token multiplies, i.e. per layer
        the query/output projections (2·h·h_attn), the key/value projections
        (2·h·kv_heads·head_dim) and the MLP (3·h·i when gated, 2·h·i otherwise; for mixture-of-experts i is the
        width of all experts a token passes through), plus the LM head (h·vocab).
        Embedding lookups, norms and softmax are left out (no matmul).
        Quadratic term a = 6·layers·h_attn: causal attention computes half of the l×l
        score matrix QKᵀ and half of the product with V, 2·l²·h_attn FLOPs forward per
        layer, tripled for backward. No per-document constant (c = 0).

        Args:
            config: The model's `transformers` config (its text config for a vision-language model).

        Returns:
            The model in FLOPs.
        """
        d = ModelDims.from_config(config)
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        per_layer = 2 * d.hidden * q + 2 * d.hidden * kv + (3 if d.gated else 2) * d.hidden * d.intermediate
        n_matmul = d.layers * per_layer + d.hidden * d.vocab
        return cls(a=6.0 * d.layers * q, b=6.0 * n_matmul, c=0.0)

    @classmethod
    def fit(cls, lengths: Sequence[int] | np.ndarray, times: Sequence[float] | np.ndarray) -> "CostModel":
        """Least-squares fit of measured times (e.g. seconds per document, profiled on
        the user's hardware) with all three coefficients kept non-negative.

        Negative coefficients would make the model extrapolate to negative or shrinking
        times, so this solves the non-negative least-squares problem exactly by trying
        every subset of free coefficients (there are only eight) and keeping the best
        feasible one.

        Args:
            lengths: The measured documents' token counts (at least 3 distinct).
            times: The measured time of each document, in the unit the model will carry.

        Returns:
            The fitted model.

        Raises:
            ValueError: Mismatched sequences, fewer than 3 distinct lengths, a value not finite or a negative length.
        """
        x = np.asarray(lengths, dtype=np.float64).ravel()
        y = np.asarray(times, dtype=np.float64).ravel()
        if x.shape != y.shape:
            raise ValueError(f"CostModel.fit: {x.size} lengths but {y.size} times")
        if x.size < 3 or np.unique(x).size < 3:
            raise ValueError(
                f"CostModel.fit needs at least 3 distinct lengths to fit a·l² + b·l + c, "
                f"got {np.unique(x).size} distinct among {x.size}"
            )
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            raise ValueError("CostModel.fit: lengths and times must be finite")
        if np.any(x < 0):
            raise ValueError(f"CostModel.fit: negative length {x[x < 0][0]!r}")
        a, b, c = _nnls(np.stack([x * x, x, np.ones_like(x)], axis=1), y)
        return cls(a=float(a), b=float(b), c=float(c))


# Attention and matmul work are equal at 16K tokens (b/a ≈ 12·hidden for a dense
# transformer, so hidden ≈ 1.4K). Pass CostModel.from_config(model.config) for your model.
DEFAULT_COST = CostModel(a=1.0, b=16384.0, c=0.0)


def _nnls(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: every subset of free columns is
    solved and the best feasible one kept. Columns are scaled to unit max first, so l² (up
    to ~1e12) does not swamp the conditioning."""
    scale = np.maximum(np.abs(design).max(axis=0), 1.0)  # [K]
    d = design / scale
    k_all = d.shape[1]
    best, best_err = np.zeros(k_all), float(np.sum(y * y))
    for k in range(1, k_all + 1):
        for free in itertools.combinations(range(k_all), k):
            sol, *_ = np.linalg.lstsq(d[:, free], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(k_all)
            coef[list(free)] = sol
            err = float(np.sum((d @ coef - y) ** 2))
            if err < best_err:
                best, best_err = coef, err
    return best / scale


@dataclass(frozen=True)
class GroupCost:
    """Per-group-size cost models for flexible sequence parallelism (FlexSP §4, Hydraulis §5).

    `models[s]` is the time one rank of an SP group of size s spends on a document of l
    tokens: T_s(l) = a_s·l² + b_s·l + d_s, which for an analytic model is
    (a·l² + b·l)/s plus the group's communication per token (Ulysses all-to-all, ring
    hops) -- see `analytic`; d_s (the model's c) is a per-DOCUMENT constant (a varlen kernel
    walking the documents). A micro-batch of a group costs the sum over its documents.
    The planner compares sizes through s·T_s(l) (rank-seconds), so the unit must be the
    same for every size. `overheads[s]` (default 0) is a constant per MICRO-BATCH of a group
    of size s (layer launches, collective latency: the c_s of T_s(docs) = Σ(a_s·l² + b_s·l
    + d_s) + c_s), paid once however many documents the group packs. `fit` measures all four.

    Args:
        models: (size, CostModel) pairs, one per group size, in any order (kept sorted).
        overheads: (size, constant) pairs: the time of one micro-batch of a group of that size beyond its documents'
            (default none: 0 for every size).

    Raises:
        ValueError: No model, a size that is not a positive int, a model that is not a `CostModel`, or an overhead
            that is negative, not finite or for a size without a model.
    """

    models: tuple[tuple[int, CostModel], ...]
    overheads: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        models = tuple(sorted(dict(self.models).items()))
        if not models:
            raise ValueError("GroupCost needs a CostModel for at least one group size")
        for size, m in models:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"GroupCost sizes must be positive ints, got {size!r}")
            if not isinstance(m, CostModel):
                raise ValueError(f"GroupCost[{size}] must be a CostModel, got {type(m).__name__}")
        object.__setattr__(self, "models", models)
        overheads = tuple(sorted((int(s), float(o)) for s, o in dict(self.overheads).items()))
        bad = [(s, o) for s, o in overheads if s not in self.sizes or not math.isfinite(o) or o < 0]
        if bad:
            raise ValueError(f"GroupCost overheads must be finite, >= 0 and for sizes with a model, got {bad}")
        object.__setattr__(self, "overheads", overheads)

    def overhead(self, size: int) -> float:
        """Constant time of one micro-batch of a group of `size` (0 unless fitted or given)."""
        return dict(self.overheads).get(size, 0.0)

    def microbatch(self, size: int, lengths: Sequence[int] | np.ndarray) -> float:
        """Modelled time of one micro-batch of a group of `size` packing documents of `lengths`."""
        return float(np.sum(self(size, np.asarray(lengths, dtype=np.float64)))) + self.overhead(size)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The group sizes with a fitted cost model, ascending."""
        return tuple(s for s, _ in self.models)

    def __getitem__(self, size: int) -> CostModel:
        for s, m in self.models:
            if s == size:
                return m
        raise ValueError(f"no cost model for group size {size}; sizes with one: {list(self.sizes)}")

    def __call__(self, size: int, length):
        return self[size](length)

    @classmethod
    def analytic(
        cls, base: CostModel, sizes: Sequence[int], *, comm_per_token: dict[int, float] | None = None
    ) -> "GroupCost":
        """T_s(l) = (a·l² + b·l)/s + comm_s·l + c: the work of `base` split over s ranks
        plus a communication time per token of the document (`comm_per_token[s]`, seconds
        or whatever `base` counts; default none)."""
        comm = comm_per_token or {}
        return cls(tuple(
            (s, CostModel(a=base.a / s, b=base.b / s + float(comm.get(s, 0.0)), c=base.c)) for s in sizes
        ))

    @classmethod
    def from_config(
        cls, config: Any, shapes: Sequence[Any], *, flops_per_s: float = 0.5 * 989e12, ulysses_bw: float = 300e9,
        ring_bw: float = 40e9, bytes_per_element: int = 2, ranks_per_node: int | None = None,
    ) -> "GroupCost":
        """Seconds per document for every group shape (`bank.shapes`, or group sizes as ints:
        each split as `group_shapes` splits it, over `ranks_per_node`, default
        `sp_groups.default_ranks_per_node(largest size)`): the model's training
        FLOPs (`CostModel.from_config`) at `flops_per_s` per rank, split over the group, plus
        the traffic a group of s = U·R ranks adds per token of a document, unoverlapped:
        Ulysses all-to-all of q, k, v and the output (2(U−1)/U of (2·h_q + 2·h_kv)·E bytes per
        layer, forward and backward, per rank's 1/s of the tokens) at `ulysses_bw`, and the
        zigzag ring's K/V passes (R−1 hops of 2·h_kv·E bytes plus fp32 log-sum-exp, per rank's
        1/s) at `ring_bw`. Defaults: an H100-class GPU at 50 % of 989 TFLOP/s, NVLink within
        a node, 40 GB/s across (the constants of benchmarks/flex_planning.py). Only ratios
        between sizes matter to the planner; on other hardware fit one (`GroupCost.fit`)."""
        d = ModelDims.from_config(config)
        if any(isinstance(sh, int) and not isinstance(sh, bool) for sh in shapes):
            from hf_longctx.sp_groups import GroupShape, default_ranks_per_node, ulysses_split

            sizes = [sh if isinstance(sh, int) else sh.size for sh in shapes]
            rpn = default_ranks_per_node(max(sizes)) if ranks_per_node is None else ranks_per_node
            shapes = [GroupShape(sh, *ulysses_split(sh, d.heads, rpn)) if isinstance(sh, int) else sh for sh in shapes]
        flops = CostModel.from_config(config)
        base = CostModel(a=flops.a / flops_per_s, b=flops.b / flops_per_s)
        q, kv, e = d.heads * d.head_dim, d.kv_heads * d.head_dim, bytes_per_element
        comm = {}
        for sh in shapes:
            s, u, r = sh.size, sh.ulysses, sh.ring
            ulysses = 2 * (u - 1) / u / s * (2 * q + 2 * kv) * e * d.layers / ulysses_bw
            ring = (r - 1) / s * 2 * kv * (2 * e + 4) * d.layers / ring_bw
            comm[s] = ulysses + ring
        return cls.analytic(base, [sh.size for sh in shapes], comm_per_token=comm)

    @classmethod
    def fit(
        cls, sizes: Sequence[int], lengths: Sequence[int] | np.ndarray, times: Sequence[float] | np.ndarray
    ) -> "GroupCost":
        """Per-size coefficients from measured micro-batch times: rows (size, documents, seconds),
        `lengths[i]` one document's length or the lengths of a packed micro-batch. Fits
        T_s(docs) = a_s·Σl² + b_s·Σl + d_s·n + c_s by non-negative least squares: c_s per
        micro-batch (`overheads`), d_s per document (the per-document models' c; a varlen
        kernel that walks the documents, the per-document padding, the metadata), where n is
        the micro-batch's document count. d_s is fitted only where the rows of a size hold
        packed micro-batches whose document counts vary independently of the constant
        (otherwise d_s = 0: single-document rows cannot tell it from c_s).

        Args:
            sizes: The group size of each measured row.
            lengths: Each row's document length, or the lengths of its packed micro-batch.
            times: Each row's measured seconds.

        Returns:
            The per-size models and per-micro-batch overheads.

        Raises:
            ValueError: The three sequences differ in length, a value is not finite or a length is negative, or a size
                has fewer than 3 distinct token totals.
        """
        sz = np.asarray(sizes).ravel()
        docs = [np.atleast_1d(np.asarray(x, dtype=np.float64)) for x in lengths]
        y = np.asarray(times, dtype=np.float64).ravel()
        if not (sz.size == len(docs) == y.size):
            raise ValueError(f"GroupCost.fit: {sz.size} sizes, {len(docs)} lengths and {y.size} times must agree")
        if not np.all(np.isfinite(y)) or any(not np.all(np.isfinite(d)) or np.any(d < 0) for d in docs):
            raise ValueError("GroupCost.fit: lengths must be finite and >= 0, times finite")
        sq = np.array([float(np.sum(d * d)) for d in docs])  # [rows] Σl²
        lin = np.array([float(np.sum(d)) for d in docs])  # [rows] Σl
        count = np.array([float(d.size) for d in docs])  # [rows] documents per micro-batch
        models, overheads = [], []
        for s in sorted({int(v) for v in sz.tolist()}):
            rows = sz == s
            if np.unique(lin[rows]).size < 3:
                raise ValueError(
                    f"group size {s}: GroupCost.fit needs at least 3 distinct token totals to fit a·Σl² + b·Σl + c, "
                    f"got {np.unique(lin[rows]).size} among {int(rows.sum())} rows"
                )
            n = count[rows]
            columns = [sq[rows], lin[rows], np.ones(int(rows.sum()))]
            if np.unique(n).size >= 2:  # the document count is identifiable apart from the constant
                columns.insert(2, n)
            coef = _nnls(np.stack(columns, axis=1), y[rows])
            a, b, c = float(coef[0]), float(coef[1]), float(coef[-1])
            d = float(coef[2]) if len(coef) == 4 else 0.0
            models.append((s, CostModel(a=a, b=b, c=d)))
            overheads.append((s, c))
        return cls(tuple(models), tuple(overheads))
