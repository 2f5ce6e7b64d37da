"""The attention function `patch()` registers with transformers, and its mask function.

Where it sits: called by every attention module of a patched HF model with q `[B, H, S, D]`
and k/v `[B, H_kv, S, D]` after RoPE (GQA not expanded); it reads the batch's global
document layout and SP group from `SP_METADATA_KEY` (never from HF's mask, which HF builds
at the LOCAL shard length), brings q/k/v to one compute dtype, and calls `ops/usp.py`
(USP paper §3-4) or `ops/fpdt.py` (FPDT paper §3), returning `[B, S, H, D]`. The
registration and undo live in `integrations/model_patch.py`, the forward hooks in
`forward_hooks.py`; `state` is the per-`patch()` binding of `patch_state.py` (mesh, options,
group bank, plan cache, call counter).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hf_longctx.data.sharding import SP_METADATA_KEY, SPBatchInfo
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NotSupported
from hf_longctx.integrations.attention_choice import attention_choice
from hf_longctx.integrations.patch_state import PatchState


# Keywords `sp_attention` APPLIES (the structural rule of probe.py lets them reach it) and
# keywords it may safely ignore (with why). Any other non-None keyword a model passes to the
# attention refuses at patch(). When the attention learns a new input (e.g. `s_aux` sinks),
# move it into USED here.
USED_ATTENTION_KWARGS = frozenset({"scaling", "dropout", "sliding_window", "softcap", "s_aux", SP_METADATA_KEY})
IGNORED_ATTENTION_KWARGS = frozenset({
    "position_ids",  # the document layout comes from SP_METADATA_KEY, built from the same positions
    "cache_position", "past_key_values", "past_key_value", "use_cache", "layer_idx",  # cache only; refused at forward
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",  # flash varlen metadata: shard_batch's replaces it
    "output_attentions",  # refused at forward
    "is_causal",  # non-causal modules are refused by refuse_inexact
    "position_embeddings",  # RoPE cos/sin, already applied to q and k by the model
    "attention_type", "head_mask",
    "labels", "shift_labels",  # loss targets (some families pass them down **kwargs, e.g. Gemma 4); not attention inputs
})


def batch_mesh(state: PatchState, info: SPBatchInfo) -> SPMesh:
    """The SP group this batch was laid out for, from the batch (`SPBatchInfo.group`) in what
    `patch()` was given (a mesh is a bank of its one size), so every layer -- and activation-
    checkpoint recomputation, which replays the same kwargs -- runs on the group the planner
    chose for this micro-batch."""
    if info.group is None:
        return state.mesh
    size, index = info.group
    bank = state.bank
    if size not in bank.sizes:
        raise ValueError(
            f"the batch was sharded for SP group (size {size}, index {index}) but the mesh (or bank) the model was "
            f"patched with has no group of size {size} (its sizes: {list(bank.sizes)}); shard with the patch() mesh, "
            "or with bank.mesh(size) of the patch() GroupBank"
        )
    mesh = bank.mesh(size)
    if mesh.dp_rank != index:
        raise ValueError(
            f"the batch was sharded for SP group (size {size}, index {index}), which covers ranks "
            f"[{index * size}, {(index + 1) * size}); rank {bank.rank}'s own group of that size is {mesh.dp_rank}"
        )
    return mesh


def make_attention(state: PatchState) -> Callable:
    """The function registered with AttentionInterface; `state` is this patch's binding."""

    def sp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        generation = state.generation  # a rollout's decode step: the new tokens against the sharded cache
        if generation is not None and generation.decoding:
            out = _decode(state, generation, module, query, key, value, scaling, dropout, kwargs)  # [1, N, H, D_v]
            state.calls += 1
            return out, None
        route = state.route  # the checkpoint mode's side of the call (attention_route.py), None without one
        if route is not None:
            replayed = route.answer(query, key, value)  # [B, S_local, H, D_v]: no kernel, no collective
            if replayed is not None:
                return replayed, None
        info = kwargs.get(SP_METADATA_KEY)
        if not isinstance(info, SPBatchInfo):
            raise ValueError(
                f"{type(module).__name__}: no '{SP_METADATA_KEY}' metadata reached the attention; call the patched model "
                "with the output of hf_longctx.shard_batch(batch, mesh) (model(**shard)), or unpatch() it first"
            )
        mesh = batch_mesh(state, info)
        if dropout:
            raise ValueError(f"{type(module).__name__}: attention dropout {dropout} cannot be exact under SP; load with it set to 0.0")
        if isinstance(attention_mask, torch.Tensor):
            raise ValueError(
                f"{type(module).__name__} received a materialised attention mask of shape {tuple(attention_mask.shape)}; "
                "under SP the document mask comes from shard_batch -- do not pass attention_mask"
            )
        if getattr(module, "is_causal", True) is False:
            raise NotSupported(
                f"{type(module).__name__}: non-causal attention (is_causal=False) is not supported under SP",
                "train this model without sequence parallelism (ulysses_degree=ring_degree=1)",
            )
        window = layer_window(state, module, kwargs)

        def prepared() -> tuple:  # (q, k, v, AttentionCall)
            return prepare(state, mesh, module, query, key, value, scaling, window, kwargs)

        def attend(save: bool) -> torch.Tensor:  # [B, S_local, H, D_v]
            q, k, v, call = prepared()
            return call.run(q, k, v, save=save)

        out = attend(True) if route is None else route.run(attend, prepared)  # [B, S_local, H, D_v]
        state.calls += 1
        return out, None

    # Under torch.compile the model's own layers (projections, RoPE, norms, MLP) are compiled
    # and this call stays out of the graph: it runs collectives, autograd Functions with
    # per-batch Python plans and data-dependent tiling, which Dynamo would split into many
    # graph breaks (and retrace per batch layout) if it traced into them.
    return torch.compiler.disable(sp_attention)


def layer_window(state: PatchState, module: Any, kwargs: dict) -> int | None:
    """The sliding window of this attention call: the keyword the layer passes, its own attribute,
    else one the model applies through its masks alone (PhiMoE: from the dry run's masks)."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is None:
        window = state.mask_window if state.probe is not None else mask_implied_window(state.mask_windows)
    return window


def _decode(state: PatchState, generation: Any, module: Any, query, key, value, scaling, dropout, kwargs: dict) -> torch.Tensor:
    """A decode step's attention (`integrations/generation_binding.py`): query [1, H, N, D], key/value
    [1, H_kv, N, D] of every row's new token -> [1, N, H, D_v], over the SP group's cache."""
    if dropout:
        raise ValueError(f"{type(module).__name__}: attention dropout {dropout} during generation; call model.eval()")
    dtype = compute_dtype(query, module)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))  # [1, N, H(_kv), D]
    d_v = v.shape[-1]
    if d_v < k.shape[-1]:  # MLA: zero value columns, as the prefill's attention pads them
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - d_v))  # [1, N, H_kv, D]
    window = layer_window(state, module, kwargs)
    softcap = kwargs.get("softcap")
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    with torch.autocast(q.device.type, enabled=False):  # fp32 inside, rounded once, as the training kernels
        out = generation.attend(state.calls, q, k, v, scale=scale, window=int(window) if window is not None else None,
                                softcap=float(softcap) if softcap else None, sinks=kwargs.get("s_aux"))
    return out if out.shape[-1] == d_v else out[..., :d_v].contiguous()


def prepare(state: PatchState, mesh: SPMesh, module: Any, query, key, value, scaling, window, kwargs: dict) -> tuple:
    """q, k, v in the layout and dtype of our attention ([B, S_local, H(_kv), D], value padded to
    the key's head dim) and the call's arguments (`AttentionCall`)."""
    info = kwargs[SP_METADATA_KEY]
    softcap = kwargs.get("softcap")
    b = query.shape[0]
    if b != info.rows:
        raise ValueError(f"the shard's metadata describes {info.rows} rows but the attention got B = {b}")
    dtype = compute_dtype(query, module)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))  # [B, S_local, H(_kv), D]
    d_v = v.shape[-1]
    if d_v > k.shape[-1]:
        raise NotSupported(
            f"{type(module).__name__}: value head dim {d_v} > key head dim {k.shape[-1]}",
            "train this model without sequence parallelism (ulysses_degree=ring_degree=1)",
        )
    if d_v < k.shape[-1]:  # MLA (DeepSeek): zero value columns give zero outputs, as HF's flash path pads
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - d_v))  # [B, S_local, H_kv, D]
    if state.generation is not None:  # a rollout's prefill: these rows' K/V stay on this rank for the decode
        state.generation.capture(state.calls, k, v)
    kw = dict(
        cu_seqlens=info.cu_seqlens if b == 1 else None,  # B > 1: one document per row
        causal=True,
        softmax_scale=scaling,
        window=int(window) if window is not None else None,
        softcap=float(softcap) if softcap else None,
        sinks=kwargs.get("s_aux"),  # per-head attention sinks [H] (GPT-OSS & co.), None elsewhere
        attention_backend=attention_choice(state.options.attention_backend, q),
    )
    return q, k, v, AttentionCall(mesh, kw, d_v, state.options.kv_offload, state.plan_cache)


class AttentionCall:
    """The arguments of one attention call besides q, k, v, and `run` to make it."""

    def __init__(self, mesh: SPMesh, kw: dict, d_v: int, offload: bool, plan_cache: dict) -> None:
        self.mesh, self.kw, self.d_v, self.offload, self.plan_cache = mesh, kw, d_v, offload, plan_cache

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, save: bool = True) -> torch.Tensor:
        """out [B, S_local, H, D_v] (USP, or FPDT when the mesh has chunks)."""
        # Our kernels accumulate in fp32 themselves; autocast must not re-cast their matmuls.
        with torch.autocast(q.device.type, enabled=False):
            if self.mesh.fpdt_chunks > 1:
                from hf_longctx.ops.fpdt import fpdt_attention

                out = fpdt_attention(q, k, v, self.mesh, offload=self.offload, plan_cache=self.plan_cache, save=save,
                                     **self.kw)  # [B, S_local, H, D]
            else:
                from hf_longctx.ops.usp import usp_attention

                out = usp_attention(q, k, v, self.mesh, plan_cache=self.plan_cache, **self.kw)  # [B, S_local, H, D]
        if out.shape[-1] != self.d_v:
            out = out[..., : self.d_v].contiguous()  # [B, S_local, H, D_v]
        return out

    def run_kept(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """USP without a graph: (out [B, S_local, H, D_v], the ring's merged out and lse to keep)."""
        from hf_longctx.ops.usp import usp_forward_kept

        with torch.autocast(q.device.type, enabled=False):
            out, ring_out, lse = usp_forward_kept(q, k, v, self.mesh, plan_cache=self.plan_cache, **self.kw)
        return (out if out.shape[-1] == self.d_v else out[..., : self.d_v].contiguous()), ring_out, lse

    def replay(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring_out: torch.Tensor, lse: torch.Tensor):
        """`run` with its ring replaced by what `run_kept` kept: differentiable, no attention kernel."""
        from hf_longctx.ops.usp import usp_replay

        with torch.autocast(q.device.type, enabled=False):
            out = usp_replay(q, k, v, self.mesh, ring_out, lse, plan_cache=self.plan_cache, **self.kw)
        return out if out.shape[-1] == self.d_v else out[..., : self.d_v].contiguous()


def compute_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype:
    """The one dtype q, k and v are brought to before sequence-parallel attention: HF's own
    flash-attention rule (`transformers.integrations.flash_attention.get_target_dtype`, not
    called because it raises StopIteration on modules without an nn.Linear, e.g. GPT-2's
    Conv1D): an fp32 query (RoPE may upcast it) runs in the autocast dtype under autocast,
    else in the quantized config's or the module's weights' dtype; any other query keeps its
    dtype. fp16 is refused: its range needs loss scaling and the ring/FPDT merges are
    verified for fp32 and bf16 only.
    """
    dtype = query.dtype
    if query.dtype == torch.float32:
        if torch.is_autocast_enabled(query.device.type):
            dtype = torch.get_autocast_dtype(query.device.type)
        elif hasattr(getattr(module, "config", None), "_is_quantized"):
            dtype = module.config.dtype
        else:  # HF looks for an nn.Linear; GPT-2's Conv1D has none, so take any floating weight
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), query.dtype)
    if dtype == torch.float16:
        raise ValueError(
            "fp16 attention is not supported by hf_longctx (its range needs loss scaling and the ring/FPDT merges are "
            "verified for fp32 and bf16 only); use bf16: Accelerate mixed_precision='bf16', TrainingArguments(bf16=True), "
            "or from_pretrained(..., dtype=torch.bfloat16)"
        )
    return dtype


def mask_implied_window(mask_windows: list) -> int | None:
    """The sliding window every mask of this forward carries (all masks built with the same
    single window), else None: with masks of several kinds (full and sliding layers) the
    attention must receive its layer's window itself (the structural rule checks it does)."""
    kinds = set(mask_windows)
    if len(kinds) == 1:
        (only,) = kinds
        if len(only) == 1:
            return next(iter(only))
    return None


_PADDING = (
    "attention_mask with padding zeros was passed to a sequence-parallel model; pass the padded batch "
    "through hf_longctx.shard_batch (it pads with separate documents) and drop attention_mask"
)


def refuse_padding(attention_mask: Any, *, read: bool = True) -> None:
    """A 2D padding mask with zeros cannot be honoured (its keys live on other ranks): refuse
    it instead of dropping it. `read=False` (a GPU mask after the first micro-batch): the
    check stays on the device (`torch._assert_async`, reported at the next synchronisation)
    so the host never waits for it."""
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        return
    if read or attention_mask.device.type == "cpu":
        if not bool(attention_mask.all()):
            raise ValueError(_PADDING)
    else:
        torch._assert_async(attention_mask.all(), _PADDING)


def make_mask_function(state: PatchState) -> Callable:
    def sp_mask(attention_mask=None, mask_function=None, **_: Any):
        """Registered with AttentionMaskInterface only when `patch()` skipped the dry run
        (otherwise the mask registry lacks our name, so HF's mask creation returns None at
        once: it would read the positions with a host sync per forward). HF calls it with
        LOCAL lengths; the real document mask is built inside the attention, so build nothing
        -- only note the mask's sliding window (`state.mask_windows`: PhiMoE applies its
        window through the mask alone) and refuse a padding mask."""
        refuse_padding(attention_mask)
        if mask_function is not None:
            from hf_longctx.integrations.probe.masks import mask_windows

            state.mask_windows.append(frozenset(mask_windows(mask_function)))
        return None

    return torch.compiler.disable(sp_mask)  # reads the mask function's closure: Python, not a graph
