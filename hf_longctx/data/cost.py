"""Per-document cost model T(l) = a·l² + b·l + c.

Where it sits: the first stage of the data flow after the sampler. `data/packing.py`
asks this model how long each document takes, so that data-parallel ranks and
micro-batches can be balanced by time rather than by token count; memory stays linear
in tokens and is capped separately by the planner.

Which paper sections: the quadratic-plus-linear execution-time estimate of Hydraulis
(its two-stage assignment dispatches documents by T(l) = a·l² + b·l + c) and the FlexSP
appendix (a profiled cost model, fitted by least squares, within ~5 % of measured time).
`CostModel.from_config` gives an analytic default in FLOPs: a dense transformer's matmul
work is linear in tokens (≈ 6·N per token for forward plus backward), while causal
attention's score and value products grow with l²·layers·hidden.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence, overload

import numpy as np

# Model families whose MLP is a plain up/down projection (two matrices); every other
# family is assumed to use a gated MLP (gate, up, down: three matrices), as Llama does.
_NON_GATED_MLP = frozenset(
    {"gpt2", "gpt_neox", "gpt_bigcode", "gptj", "gpt_neo", "starcoder2", "opt", "bloom",
     "falcon", "phi", "codegen", "mpt"}
)


def _first_attr(config: Any, names: Sequence[str], what: str, required: bool = True) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if required:
        raise ValueError(
            f"CostModel.from_config: config of type {type(config).__name__} has no {what} "
            f"(looked for attributes {', '.join(names)})"
        )
    return None


@dataclass(frozen=True)
class CostModel:
    """Estimated time (or FLOPs) of one document of `l` tokens: a·l² + b·l + c.

    The unit is whatever the coefficients carry: FLOPs for `from_config`, seconds for
    `fit`. Only ratios matter to the planner, so any consistent unit works.
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
        (2·h·kv_heads·head_dim) and the MLP (3·h·i when gated, 2·h·i otherwise, using the
        active experts' width for mixture-of-experts), plus the LM head (h·vocab).
        Embedding lookups, norms and softmax are left out (no matmul).
        Quadratic term a = 6·layers·h_attn: causal attention computes half of the l×l
        score matrix QKᵀ and half of the product with V, 2·l²·h_attn FLOPs forward per
        layer, tripled for backward. No per-document constant (c = 0).
        """
        h = int(_first_attr(config, ("hidden_size", "n_embd", "d_model"), "hidden size"))
        layers = int(_first_attr(config, ("num_hidden_layers", "n_layer", "num_layers"), "layer count"))
        vocab = int(_first_attr(config, ("vocab_size",), "vocabulary size"))
        heads = int(_first_attr(config, ("num_attention_heads", "n_head", "num_heads"), "head count"))
        head_dim = _first_attr(config, ("head_dim",), "head dimension", required=False)
        head_dim = int(head_dim) if head_dim else h // heads
        kv_heads = _first_attr(config, ("num_key_value_heads", "n_head_kv"), "kv heads", required=False)
        kv_heads = int(kv_heads) if kv_heads else heads
        if getattr(config, "multi_query", False):
            kv_heads = 1  # GPTBigCode flags MQA this way instead of num_key_value_heads
        h_attn = heads * head_dim

        experts_per_tok = getattr(config, "num_experts_per_tok", None)
        moe_width = getattr(config, "moe_intermediate_size", None)
        if experts_per_tok and moe_width:
            inter = int(experts_per_tok) * int(moe_width)
        else:
            inter = _first_attr(config, ("intermediate_size", "n_inner", "ffn_dim"), "MLP width", required=False)
            inter = int(inter) if inter else 4 * h  # GPT-2 leaves n_inner=None meaning 4h
        mlp_mats = 2 if getattr(config, "model_type", "") in _NON_GATED_MLP else 3

        per_layer = 2 * h * h_attn + 2 * h * kv_heads * head_dim + mlp_mats * h * inter
        n_matmul = layers * per_layer + h * vocab
        return cls(a=6.0 * layers * h_attn, b=6.0 * n_matmul, c=0.0)

    @classmethod
    def fit(cls, lengths: Sequence[int] | np.ndarray, times: Sequence[float] | np.ndarray) -> "CostModel":
        """Least-squares fit of measured times (e.g. seconds per document, profiled on
        the user's hardware) with all three coefficients kept non-negative.

        Negative coefficients would make the model extrapolate to negative or shrinking
        times, so this solves the non-negative least-squares problem exactly by trying
        every subset of free coefficients (there are only eight) and keeping the best
        feasible one.
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
        # Scale columns to unit max so l² (up to ~1e12) does not swamp the conditioning.
        scale = np.array([max(x.max(), 1.0) ** 2, max(x.max(), 1.0), 1.0])
        design = np.stack([x * x, x, np.ones_like(x)], axis=1) / scale
        best, best_err = np.zeros(3), float(np.sum(y * y))
        for k in (1, 2, 3):
            for free in itertools.combinations(range(3), k):
                sol, *_ = np.linalg.lstsq(design[:, free], y, rcond=None)
                if np.any(sol < 0):
                    continue
                coef = np.zeros(3)
                coef[list(free)] = sol
                err = float(np.sum((design @ coef - y) ** 2))
                if err < best_err:
                    best, best_err = coef, err
        a, b, c = best / scale
        return cls(a=float(a), b=float(b), c=float(c))
