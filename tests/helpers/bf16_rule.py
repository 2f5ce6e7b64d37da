"""The bf16 criterion ("the 2× rule") and the packed documents the bf16 tests step on.

Per VECTOR (a gradient tensor, the per-token losses), a bf16 run passes when
‖g − g64‖ ≤ 2·‖g₁ − g64‖ + 1e-6·‖g64‖: g64 the float64 truth, g₁ the unpatched model in one
process in the same regime (tests/distributed/test_bf16.py's docstring says why). The SP run
and the one-process run round at the same sites in a different order, so their errors are two
draws of the same rounding noise: over n independent entries the ratio of their norms is
1 ± O(1/√n) (F(n, n) distribution: P(ratio > 2) < 1e-9 at n = 128), so 2 leaves room for the
few roundings the SP path may add and no more. The ratio of two SCALAR draws has no such bound
(|X/Y| of two Gaussians: > 2 about 30 % of the time; the CPU's bf16 kernels -- AVX2,
AVX512, AVX512-BF16, AMX -- change which draw a run gets), so a scalar is never judged by it:
a loss that is a sum of per-token terms is judged by its terms (the vector rule) and its own
reduction arithmetic (`reduction_excess`: |L − Σℓ/N| ≤ γ_n·Σ|ℓ|/N, fp32, Higham's summation
bound), which with Cauchy-Schwarz bounds |L − L64|; a scalar the test sees only as a value
(a Trainer's logged loss) gets `scalar_excess`: the one-process error plus one bf16 rounding
of its magnitude. `criterion` applies the vector rule to one tensor,
`pooled_small` judges tensors of fewer than SMALL entries together, `excess` to a whole step
(per-token losses, loss, every gradient) and `_check` asserts a pool's results. `_docs`,
`_flat` and `_targets` build the step's packed batch (DP rank d of dp takes DOCS[d::dp]);
`_fresh` loads a saved model once per process and hands out copies; `_single` and
`token_losses` give the one-process per-token losses and gradients. Used by the bf16 tests
of the models, trainers and mixers on gloo and on GPUs (tests/gpu/).
"""

from __future__ import annotations

import copy

import torch

DOCS = [7, 23, 5, 14, 11, 9]  # DP rank d of dp takes DOCS[d::dp]

_MODELS: dict = {}  # per worker process: path -> fp32 model loaded once (tests copy it)


def _docs(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in DOCS]


def _flat(docs):
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")([{"input_ids": d} for d in docs])


def _targets() -> int:
    return sum(n - 1 for n in DOCS)


def _fresh(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    return copy.deepcopy(_MODELS[path]).to(dtype)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-target cross-entropy [N] (float64) in document order from [1, S, V] logits and HF's
    unshifted labels [1, S] (-100 at each document's first token)."""
    shifted = labels[0, 1:]  # [S-1]: the target of position t
    keep = shifted != -100
    ce = torch.nn.functional.cross_entropy(logits[0, :-1].float(), shifted, ignore_index=-100, reduction="none")
    return ce[keep].double()  # [N]


def _single(model, autocast: bool, seed: int = 0):
    """Unpatched one-process per-token losses, loss and gradients (float64) on all documents."""
    batch = _flat(_docs(seed))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters()}
    return token_losses(out.logits.detach(), batch["labels"]), grads


def _doc_slice(tokens: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """The entries of per-token losses [N] that belong to DP rank `dp_rank`'s documents."""
    pieces = torch.split(tokens, [n - 1 for n in DOCS])
    return torch.cat(pieces[dp_rank::dp])


SMALL = 128  # elements: below this a tensor's error norm is judged together with the other small ones


def pooled_small(rows: list[tuple]) -> list[tuple]:
    """(name, truth, single, run) rows with every tensor of fewer than SMALL elements pooled
    into one row. The 2x rule compares two norms of independent bf16 rounding errors; over n
    elements their ratio spreads like 1/sqrt(n), so for a norm weight of head_dim = 8 entries
    or a 32-entry bias it exceeds 2 by chance (seen: 2.2x-2.4x on such tensors while every
    large tensor sat at 0.9-1.1x). Pooled, the small tensors are judged over a few hundred
    entries; every larger tensor is still judged alone."""
    big = [r for r in rows if r[1].numel() >= SMALL]
    small = [r for r in rows if r[1].numel() < SMALL]
    if small:
        cat = lambda i: torch.cat([r[i].double().flatten() for r in small])  # noqa: E731
        big.append((f"{len(small)} tensors < {SMALL} entries", cat(1), cat(2), cat(3)))
    return big


def criterion(truth: torch.Tensor, single: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """The 2x rule on one tensor: (‖ours − truth‖ − (2·‖single − truth‖ + 1e-6·‖truth‖), the
    error ratio); the first > 0 is a failure."""
    err, err1 = (ours - truth).norm().item(), (single - truth).norm().item()
    return err - (2 * err1 + 1e-6 * truth.norm().item()), err / max(err1, 1e-30)


U_BF16 = 2.0**-8  # bf16 unit roundoff: 8 significand bits, round to nearest
U_FP32 = 2.0**-24


def scalar_excess(ours: float, single: float, truth: float, roundings: int = 1) -> tuple[float, float]:
    """A scalar the test sees only as a value (e.g. a Trainer's logged loss): (|ours − truth| −
    (|single − truth| + roundings·U_BF16·|truth|), error ratio to that allowance); > 0 fails. Its
    error and the one-process error are single draws of the same noise (no ratio bound), each
    far below one bf16 rounding of the value (losses: 1e-5..2e-4 relative, U_BF16 = 3.9e-3),
    so their difference is bounded by `roundings` bf16 roundings of the value: what an extra
    bf16 cast of the scalar on the SP path would cost. A lost document or a normaliser off by
    one of ~100 targets (>= 1e-2 relative) exceeds it."""
    err, err1 = abs(ours - truth), abs(single - truth)
    allowance = err1 + roundings * U_BF16 * abs(truth)
    return err - allowance, err / max(allowance, 1e-30)


def reduction_excess(loss: float, tokens: torch.Tensor, n_targets: int, ranks: int) -> tuple[float, float]:
    """The SP loss against the per-token losses it is the sum of: (|L − Σℓ/N| − γ·Σ|ℓ|/N, ratio),
    γ = n·u/(1 − n·u) for n = the tokens plus the ranks' partial sums, u = fp32's unit roundoff
    (every rank sums its terms in fp32 and the ranks' sums are added in fp32). A bf16 rounding of
    the loss, a wrong normaliser or a rank's share counted twice exceeds it by orders of magnitude."""
    n = tokens.numel() + ranks
    gamma = n * U_FP32 / (1 - n * U_FP32)
    tokens = tokens.double()
    err, allowance = abs(loss - tokens.sum().item() / n_targets), gamma * tokens.abs().sum().item() / n_targets
    return err - allowance, err / max(allowance, 1e-30)


def excess(truth, single, run, dp_rank: int = 0, dp: int = 1) -> dict[str, tuple[float, float]]:
    """Per tensor: (‖g − g64‖ − (2·‖g₁ − g64‖ + 1e-6·‖g64‖), ‖g − g64‖ / ‖g₁ − g64‖); the first
    > 0 is a failure. "tokens" applies the criterion to this DP rank's per-token losses ℓ: the
    loss is their sum / N, and a scalar's two bf16 errors are single random draws whose ratio
    exceeds 2 about 30% of the time, while a vector's norm averages. "loss" then checks the
    scalar with the bound this implies (Cauchy-Schwarz): |L − L64| ≤ bound(ℓ)·√N_rank / N."""
    (tok64, g64), (tok1, g1), (tok, loss, g) = truth, single, run
    tok64, tok1 = _doc_slice(tok64, dp_rank, dp), _doc_slice(tok1, dp_rank, dp)
    out = {}
    per_token = [("tokens", tok64, tok1, tok)] if tok is not None else []  # None: chunked loss, no logits
    for name, t, s, r in per_token + pooled_small([(n, g64[n], g1[n], g[n]) for n in g64]):
        out[name] = criterion(t, s, r.double())
    n_all = sum(n - 1 for n in DOCS)
    bound = (2 * (tok1 - tok64).norm().item() + 1e-6 * tok64.norm().item()) * tok64.numel() ** 0.5 / n_all
    err = abs(loss.item() - tok64.sum().item() / n_all)  # this DP group's share of the step loss
    out["loss"] = (err - bound, err / max(bound / 2, 1e-30))
    return out


def _check(results: list[dict]) -> None:
    bad = []
    for rank, per_case in enumerate(results):
        for case, per_tensor in per_case.items():
            over = {n: v for n, v in per_tensor.items() if v[0] > 0}
            if over:
                worst = max(over, key=lambda n: over[n][1])
                bad.append(f"rank {rank} {case}: {len(over)} tensors over the bound, worst {worst} at "
                           f"{over[worst][1]:.2f}x the single-process bf16 error")
    assert not bad, "\n".join(bad)


def references(path: str) -> dict:
    """g64 and g₁ of every regime (see the module docstring)."""
    truth32 = _single(_fresh(path, torch.float32).double(), False)
    truth_bf = _single(_fresh(path, torch.bfloat16).double(), False)  # fp64 of the bf16-rounded weights
    one_auto = _single(_fresh(path, torch.float32), True)
    one_bf = _single(_fresh(path, torch.bfloat16), False)
    return {"autocast": (truth32, one_auto), "fsdp": (truth32, one_bf), "bf16": (truth_bf, one_bf)}
