"""What a rollout generated on the training GPUs costs in device memory, per GPU: sequence-parallel
(`sp_generate`) or per rank (transformers' `generate` on the gathered model).

Where it sits: `capacity/estimate.estimate_memory(task="grpo"|"rloo", rollout_tokens=, generation=)`
adds it beside the shards that stay through the rollout (parameters, optimizer states, the
reference); `hf-longctx plan --generation sp|per-rank` chooses. Each term is a tensor of the census
`benchmarks/generation_memory.py` takes of a real `sp_generate`, written from the model's sizes:
- the cache (`ops/decode_cache.py`): every layer's K and V of the rank's share of the rollout's
  tokens (prompt + completion of the SP group's rows, 1/SP of them: all KV heads, no replication),
  and each slot's row and position (int64);
- the prefill (a no-grad patched forward over the packed prompts, sharded as a training step):
  one layer's working set, as the frozen reference's forward of `capacity/task_budget.py`, beside
  the cache filling up, and each layer's K/V rows copied into their slots;
- a decode step: one split-KV chunk's gathered queries, scores and weighted values (fp32), the
  next-token logits of every row;
- the weights: "gathered" adds the whole model in the compute dtype (less FSDP's working set, which
  the step's estimate holds already); "sharded" adds nothing (FSDP2 gathers a unit per forward);
- or the cache in pinned host memory (`cache="host"`): its K/V become host bytes, the device keeps
  the slots' rows and positions and the K/V on their way (read over PCIe every decode step: for
  lengths no device holds, at a decode speed bound by the host link).
The per-rank path (`generation_bytes`): the whole model, each GPU's rows' whole cache and an
unsharded prefill layer. Design: docs/DESIGN.md "Generation is sequence-parallel too"."""

from __future__ import annotations

from hf_longctx.capacity.budget_terms import DTYPE_BYTES, Budget, Phase, Sizes, pinned, token_chunks
from hf_longctx.data.model_dims import ModelDims
from hf_longctx.ops.decode_attention import DEFAULT_CHUNK
from hf_longctx.ops.ulysses import kv_replication

GENERATION = ("sp", "per-rank")
ROWS = 64  # rows of a rollout when the planner is not told (logits [rows, V] per step; a small term)


def cache_bytes_per_token(dims: ModelDims, dt: int) -> float:
    """K and V of every layer (all KV heads) plus the slot's row and position (two int64)."""
    return dims.layers * 2 * dims.kv_heads * dims.head_dim * dt + 16


def _attention_points(z: Sizes, s, S: float, kv: float) -> dict:
    """The attention call's peaks beyond the layer's q, k, v: Ulysses' all-to-all in (K/V replicated
    when H_kv < U, the send buffer, the receive buffer of the head-sharded q, k, v), the attention
    (the ring's fp32 accumulators with its K/V in flight, else the kernel's output) and the all-to-all
    out (the output, its send copy and receive buffer), the receive buffer held throughout; on FPDT's
    chunk rows where it chunks."""
    c = S / s.fpdt_chunks if s.fpdt_chunks > 1 else S
    qkv = (z.qb + 2 * z.kvb) * c  # head-sharded q, k, v of the rank's ring stream (or of one FPDT chunk)
    # the attention itself: the ring's fp32 accumulators with its K/V in flight (packed to send,
    # received) and fp32 LSE; without a ring the kernel's output
    attend = ({"prefill: ring K/V in flight (sent, received), fp32 out and lse accumulators":
               (4 * z.kvb + 2 * z.qb + z.lse) * c} if s.ring > 1 else {"prefill: the attention output": z.qb * c})
    if s.ulysses == 1:
        return {"attention": attend}
    held = {"prefill: the all-to-all's q, k, v receive buffer": qkv}
    rep = 2 * z.kvb * c if z.kvb > kv else 0.0  # repeat_interleave's copies of k and v (H_kv < U)
    points = {"all-to-all in": {"prefill: the all-to-all's replicated K/V and send buffer": rep + qkv} | held,
              "attention": attend | held,
              "all-to-all out": held | {"prefill: the output, its all-to-all send copy and receive buffer": 3 * z.qb * c}}
    return points


def _prefill_phases(z: Sizes, dims: ModelDims, s, S: float, r: float, kv: float) -> dict:
    """The prefill's peaks: a layer's attention call (`_attention_points`) and its output projection
    beside its input, norm output and q, k, v (a model's attention forward holds them to its end);
    its MLP on a row chunk; for layers run whole or row-chunked (memory="max":
    `LayerRun`'s output buffer, the layer's q, k, v assembled from the row chunks, the attention
    output of all rows, one chunk's residual, norm output and I-wide tensors). Every phase: the
    embedding output (the model's forward holds it to the end), RoPE's cos/sin, the shard's ids,
    positions and local indices."""
    common = {"prefill: embedding output (held by the model's forward)": z.v * S, "prefill: rotary cos/sin": z.rope * S,
              "prefill: the shard's input ids, positions and local indices (int64)": 24 * S}
    wide = (3 if dims.gated else 2) * z.ib  # at the MLP's peak: act(gate), up and their product (no grad: gate freed)
    if s.checkpoint is True and s.mlp_chunks > 1:  # memory="max": row-chunked layers (LayerSplit.call_no_grad)
        layer = {"prefill: layer input and the layer's output buffer": 2 * z.v * S}
        attention = {"prefill: the layer's q, k, v (assembled from the row chunks)": (z.qb + 2 * kv) * S}
        mlp = {"prefill: the layer's attention output (all rows)": z.qb * S,
               "prefill: a row chunk's attention residual and norm output": 2 * z.v * r,
               "prefill: a row chunk's MLP (I-wide)": wide * r}
    else:
        layer = {"prefill: layer input and norm output": 2 * z.v * S}
        attention = {"prefill: q and k after RoPE, v": (z.qb + 2 * kv) * S}
        mlp = {"prefill: attention residual": z.v * S, "prefill: a row chunk's MLP (I-wide)": wide * r,
               "prefill: the finished MLP chunks' outputs": (S - r) * z.v}
    points = _attention_points(z, s, S, kv)
    if not (s.checkpoint is True and s.mlp_chunks > 1):  # the layer's q, k, v live on through its o_proj
        points["output projection"] = {"prefill: the attention output and its projection": (z.qb + z.v) * S}
    phases = {f"prefill: attention ({point})": common | layer | attention | terms for point, terms in points.items()}
    phases["prefill: MLP"] = common | layer | mlp
    return phases


def sp_generation_budget(dims: ModelDims, s, *, tokens: int, dtype: str = "bf16", rows: int = ROWS,
                         prompt_tokens: int | None = None, cache_on_host: bool = False) -> Budget:
    """Device bytes above the weights of `sp_generate` on one GPU of setting `s` (a capacity
    `Setting`) for a rollout of `tokens` prompt + completion tokens over the SP group and `rows` rows
    (`prompt_tokens` of them prompts; unknown: all, the prefill's worst case): the prefill's and a
    decode step's phases, the cache held through all of them -- or, `cache_on_host`, its K/V in
    page-locked host buffers (the budget's host terms: two per layer, at the pool's size classes),
    the device holding the slots' rows and positions, a prefill layer's K/V rows on their way to the
    host and a decode chunk's K/V brought back."""
    dt = DTYPE_BYTES[dtype]
    z = Sizes.of(dims, dt, kv_replication(dims.heads, dims.kv_heads, s.ulysses))
    S = tokens / s.sp
    P = (tokens if prompt_tokens is None else prompt_tokens) / s.sp
    r = P / token_chunks(dims, s.mlp_chunks, int(P))
    kv, c = dt * dims.kv_heads * dims.head_dim, min(DEFAULT_CHUNK, S)
    host = {}
    if cache_on_host:
        held = {"K/V cache slots' rows and positions (int64)": 16 * S}
        host = {"K/V cache (every layer, the rank's tokens; pinned)": pinned(2 * dims.layers, kv * S)}
        moving = {"prefill: a layer's K/V rows copied to the host": 2 * kv * P}
        decode_kv = {"decode: a chunk's K/V brought to the device": 2 * kv * c}
    else:
        held = {"K/V cache (every layer, the rank's tokens) and its slots' rows and positions":
                cache_bytes_per_token(dims, dt) * S}
        moving, decode_kv = {}, {}
    phases = [Phase(name, held | terms | moving) for name, terms in _prefill_phases(z, dims, s, P, r, kv).items()]
    h, d = dims.heads, dims.head_dim
    decode = {"decode: a split-KV chunk's queries, scores and weighted values (fp32)": c * h * (2 * 4 * d + 3 * 4),
              "decode: every row's next-token logits (fp32)": rows * dims.vocab * 4 * 2} | decode_kv
    phases.append(Phase("decode step", held | decode))
    return Budget(tuple(phases), host, float(sum(held.values())))


def sp_generation_memory(dims: ModelDims, s, *, tokens: int, dtype: str, weights: str, fsdp_gathered: float,
                         world: int, rows: int = ROWS, cache_on_host: bool = False) -> tuple[float, float]:
    """(device, host) bytes of the rollout beside the step's parameters, optimizer states and held
    gradients: its budget's peak, plus the whole model gathered once ("gathered": dt x params, less
    `fsdp_gathered`, FSDP's working set the step's estimate already holds) or nothing more
    ("sharded": FSDP2 gathers each unit as it runs; one GPU holds its weights anyway); the host
    bytes of a host-resident cache."""
    if weights not in ("gathered", "sharded"):
        raise ValueError(f"weights must be 'gathered' or 'sharded', got {weights!r}")
    dt = DTYPE_BYTES[dtype]
    extra = max(0.0, dt * dims.params - fsdp_gathered) if weights == "gathered" and world > 1 else 0.0
    budget = sp_generation_budget(dims, s, tokens=tokens, dtype=dtype, rows=rows, cache_on_host=cache_on_host)
    return extra + budget.device, budget.host


def sp_rollout_tokens_within(dims: ModelDims, s, dtype: str, memory, tokens: int, usable: float) -> int:
    """The most rollout tokens of the SP group whose sequence-parallel generation fits in `usable`
    device bytes at setting `s` beside the shards that stay (`memory`: an `estimate.MemoryEstimate`
    with `tokens` rollout tokens charged; its weights' part is kept as it is); 0 when none does.
    Bisection: the phase grows with the tokens (linearly but for the decode chunk's min(chunk, S))."""
    on_host = memory.generation_cache == "host"
    weights = memory.generation - sp_generation_budget(dims, s, tokens=tokens, dtype=dtype, cache_on_host=on_host).device
    fixed = memory.params + memory.optimizer + memory.held + weights

    def fits(n: int) -> bool:
        return fixed + sp_generation_budget(dims, s, tokens=n, dtype=dtype, cache_on_host=on_host).device <= usable

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
