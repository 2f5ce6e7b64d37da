"""Per-GPU memory model of one training step (what `hf-longctx plan` ranks settings by).

Where it sits: outside the training data flow. `capacity/search.py` calls `estimate_memory`
for every (ulysses, ring, fpdt chunks, offload, checkpointing) setting;
`benchmarks/memory_model.py` compares it with peaks measured by MemTracker.
Papers: FPDT §3-4 (activations linear in local tokens, K/V chunks and layer inputs on the
host, chunked FFN and loss) and USP §4 (ZeRO-3 over DP×SP, "Tip 3").
Every term is bytes per GPU; peak = params + optimizer + held + max(grads, activations +
buffers + backward_grads), activations from `capacity/budget.step_budget`. The assumptions
(ZeRO-3 terms, gradient sync, parameter offload, unsharded steps) are printed under the plan
table and listed in docs/DESIGN.md "The planner's models"."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from hf_longctx.data.model_dims import ModelDims
from hf_longctx.capacity.budget import step_budget
from hf_longctx.capacity.budget_terms import DTYPE_BYTES, KERNEL_TERM, Phase
from hf_longctx.capacity.generation_budget import GENERATION, sp_generation_memory
from hf_longctx.capacity.task_budget import HOLDS_REFERENCE, generation_bytes


@dataclass(frozen=True)
class Setting:
    """One parallel/memory configuration; chunk counts of 1 mean "off"."""

    ulysses: int
    ring: int
    fpdt_chunks: int = 1
    kv_offload: bool = False
    checkpoint: bool | str = False  # True: whole layers recomputed; "attention": all but the attention
    mlp_chunks: int = 1
    loss_chunks: int = 1
    param_offload: bool = False  # FSDP2 CPUOffloadPolicy: sharded params, grads, optimizer states on host
    inputs_on_device: int = 0  # decoder layers whose checkpointed inputs stay on the device (the last ones)
    keep_attention: bool = False  # row-chunked layers keep the attention's output and LSE (patch(keep_attention=))
    fused: bool = False  # patch(fused=True): the elementwise regions compiled (the step time's launches and bytes)
    loss_chunk_rows: int = 0  # patch(loss_chunk_rows=R) where GPU memory binds; 0: the rule's own (ops/loss_rows.py)

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by kind, the step peak, and the host bytes this GPU offloads."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    host: float
    held: float = 0.0  # fp32 gradients of the step's earlier micro-batches, next to the later ones' activations
    backward_grads: float = 0.0  # gradients already made (LM head, later layers) when the binding layer backward runs
    generation: float = 0.0  # rollouts on the training GPUs: weights gathered or not, KV cache, prefill (no grads)
    generation_weights: str = ""  # sequence-parallel rollouts: "gathered" (once per rollout) or "sharded" (per unit)
    generation_cache: str = ""  # sequence-parallel rollouts: their K/V cache on the "device" or the "host"

    @property
    def peak(self) -> float:
        return max(self.training_peak, self.params + self.optimizer + self.held + self.generation)

    @property
    def training_peak(self) -> float:
        """The peak of the training step alone, without the rollouts' phase (which the planner
        names apart where it binds)."""
        return self.params + self.optimizer + self.held + max(self.grads, self.activations + self.buffers
                                                              + self.backward_grads)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("generation_")} | {
            "peak": self.peak}


def kept_attention_bytes(dims: ModelDims, dt: int, f: int, s: Setting) -> float:
    """Bytes per token and layer that checkpoint="attention" moves to the host and back for the
    attention: its saved q, k, v, out, fp32 LSE and the output replayed in the recompute
    (`capacity/budget.py`); with FPDT's K/V offload, whose chunk store holds q, k, v and LSE on
    the host already, only the output."""
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim * f
    if s.fpdt_chunks > 1 and s.kv_offload:
        return dt * q
    return dt * (3 * q + 2 * kv) + 4 * dims.heads


def estimate_memory(
    dims: ModelDims, setting: Setting, *, world: int, tokens: int, dtype: str = "bf16", optimizer: str = "adamw",
    unsharded_step: bool = False, grad_sync: str = "step", microbatches: int = 1, offload: bool = True,
    kernel_workspace: float | None = None, task: str = "sft", rollout_tokens: int = 0, generation: str = "sp",
    generation_weights: str = "gathered", generation_cache: str = "device") -> MemoryEstimate:
    """Per-GPU bytes of one step on `world` GPUs, `tokens` per SP group and micro-batch.

    `optimizer`: "adamw" (two fp32 moments) or "sgd" (stateless). `unsharded_step`: the
    unequal-count mode of flexible SP groups (parameters and gradients unsharded for the
    whole step). `grad_sync`: "step" (reduce-scatter in the step's last backward; unsharded
    fp32 gradients held until then) or "microbatch" (every backward). `microbatches`: per rank
    and optimizer step (1: no earlier gradients are held). `kernel_workspace`: bytes one local
    attention kernel call allocates beyond its outputs, where the backend is not flash-attn 2
    (e.g. the CPU kernel's, measured). `task`, `rollout_tokens`, `generation*`: the rollouts
    (`_rollouts`). Raises ValueError when the setting cannot run (degrees, heads not divisible)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    if grad_sync not in ("step", "microbatch"):
        raise ValueError(f"grad_sync must be 'step' or 'microbatch', got {grad_sync!r}")
    if unsharded_step and grad_sync != "step":
        raise ValueError("unsharded_step=True syncs gradients in each rank's last backward: grad_sync must be 'step'")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1 (micro-batches per rank and step), got {microbatches!r}")
    s = setting
    if world % s.sp:
        raise ValueError(f"ulysses({s.ulysses}) x ring({s.ring}) = {s.sp} does not divide {world} GPUs")
    if s.fpdt_chunks > 1 and s.ring > 1:
        raise ValueError(f"fpdt_chunks({s.fpdt_chunks}) > 1 needs ring 1, got ring {s.ring}")
    if s.kv_offload and s.fpdt_chunks < 2:
        raise ValueError(f"kv_offload needs fpdt_chunks > 1, got fpdt_chunks {s.fpdt_chunks}")
    dt = DTYPE_BYTES[dtype]
    P = dims.params

    # ZeRO-3 shards plus FSDP's unsharded working set (none on one GPU: nothing to gather).
    master = 4 * P / world
    # FSDP units (integrations/accelerate.py): each decoder layer, the vocabulary matrices
    # (embedding and LM head, one unit when tied), both resharded after use, and the root
    # (final norm) kept unsharded. Gathered at once: two layers (running + prefetched), or
    # the LM head and the layer prefetched next to it; unsharded gradients: one unit's.
    vocab_unit = dims.vocab * dims.hidden
    rest = max(0, dims.root_params - vocab_unit * (1 if dims.tied else 2))
    # With the parameters on the host (param offload) even one GPU holds the units it runs.
    units_on_gpu = world > 1 or s.param_offload
    gathered = dt * (rest + max(2 * dims.layer_params, vocab_unit + dims.layer_params)) if units_on_gpu else 0.0
    unsharded_grads = dt * (rest + max(dims.layer_params, vocab_unit)) if units_on_gpu else 0.0
    # fp32 gradients of the earlier micro-batches: unsharded until the last backward, or sharded.
    held = (4.0 * P if grad_sync == "step" else 4.0 * P / world) if world > 1 and microbatches > 1 else 0.0
    if unsharded_step and world > 1:
        gathered = dt * P  # the whole model, gathered once at the step's start
        unsharded_grads = dt * max(dims.layer_params, vocab_unit, rest)  # one unit's, before accumulation
    sharded_grads = 4 * P / world
    optim = (8 * P / world) if optimizer == "adamw" else 0.0
    host = 0.0
    reference = 4 * P / world if task in HOLDS_REFERENCE else 0.0  # the frozen reference's shards, in the policy's fp32
    if s.param_offload:  # the fp32 shards and the optimizer states live on host (CPUOffloadPolicy)
        host += master + sharded_grads + optim + reference
        master = sharded_grads = optim = reference = 0.0
        if grad_sync == "microbatch":
            held = 0.0  # the accumulated sharded gradients are the host shards above
    params, grads = master + gathered + reference, sharded_grads + unsharded_grads
    rollouts, rollout_host, weights, cache = _rollouts(dims, s, task, rollout_tokens, dtype, generation,
                                                       generation_weights, generation_cache, gathered, world)

    # Activations and transients: the per-token budget of capacity/budget.py (every tensor of
    # the step by name and phase); `activations` is what the whole step holds, `buffers` the
    # rest of the binding phase.
    budget = step_budget(dims, s, tokens=tokens, dtype=dtype, offload=offload, task=task)
    if kernel_workspace is not None:
        budget = _with_kernel_workspace(budget, kernel_workspace)
    made = 0.0 if held or s.param_offload else _grads_before_layer_backward(
        dims, s, budget, world=world, tokens=tokens, dtype=dtype, offload=offload, head=vocab_unit + rest)
    device, binding = max((p.total + made * p.name.startswith("layer backward"), p.name) for p in budget.phases)
    backward_grads = made if binding.startswith("layer backward") else 0.0
    activations, buffers = budget.held, device - backward_grads - budget.held
    return MemoryEstimate(params, grads, optim, activations, buffers, host + max(budget.host, rollout_host), held,
                          backward_grads, rollouts, weights, cache)  # the step's offloads or the rollouts' cache


def _rollouts(dims: ModelDims, s: Setting, task: str, tokens: int, dtype: str, generation: str, weights: str,
              cache: str, gathered: float, world: int) -> tuple[float, float, str, str]:
    """(device bytes above the step's shards, host bytes, weights placement, cache placement) of the
    rollouts of "grpo" / "rloo": `generation` "sp" (`capacity/generation_budget.py`: `weights`
    "gathered" / "sharded", the cache on the "device" / "host") or "per-rank"
    (`task_budget.generation_bytes`). A host-resident cache and the step's offloads never coexist:
    sp_generate releases the pool's free pinned buffers first (`ops/offload.release_pinned`)."""
    if generation not in GENERATION:
        raise ValueError(f"generation must be one of {GENERATION}, got {generation!r}")
    if task not in ("grpo", "rloo") or not tokens:
        return 0.0, 0.0, "", ""
    if generation == "per-rank":
        return generation_bytes(dims, DTYPE_BYTES[dtype], tokens) - gathered, 0.0, "", ""
    device, host = sp_generation_memory(dims, s, tokens=tokens, dtype=dtype, weights=weights, fsdp_gathered=gathered,
                                        world=world, cache_on_host=cache == "host")
    return device, host, weights, cache


def _grads_before_layer_backward(dims: ModelDims, s: Setting, budget, *, world: int, tokens: int, dtype: str,
                                 offload: bool, head: float) -> float:
    """fp32 gradient bytes (sharded over `world`) already made when a layer's backward runs:
    the LM head's and final norm's (`head` parameters), and the later layers' less the
    activations their backward freed. Linear in the layer index, so the first or the last
    layer of the backward is the worst."""
    freed = 0.0
    if dims.layers > 1:
        fewer = step_budget(replace(dims, layers=dims.layers - 1), s, tokens=tokens, dtype=dtype, offload=offload)
        freed = budget.held - fewer.held  # one layer's held activations
    return 4 * head / world + (dims.layers - 1) * max(0.0, 4 * dims.layer_params / world - freed)


def _with_kernel_workspace(budget, workspace: float):
    """`budget` with the local attention kernel's workspace replaced by `workspace` bytes."""
    return replace(budget, phases=tuple(Phase(p.name, p.terms | {KERNEL_TERM: workspace}) if KERNEL_TERM in p.terms
                                        else p for p in budget.phases))
