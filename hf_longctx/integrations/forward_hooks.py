"""The forward hooks a patched model runs around every forward.

Where it sits: `integrations/model_patch.patch` registers them on the HF model; the pre-hook
runs before the first layer, the post-hook after the output. Guarantees: a KV cache,
`output_attentions`, `output_router_logits` and padding are refused; a forward without
`shard_batch`'s metadata raises; the ranks of the SP group hold shards of one batch
(invariant 3: one small all_gather per micro-batch, host-free after the first); the per-batch
state (call counter, mask windows, ring plans, mixer layout) is reset before the layers run;
afterwards the forward made as many attention calls as the dry run. torch.compile traces
neither hook."""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from hf_longctx.data.sharding import SP_METADATA_KEY, SPBatchInfo
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.attention import batch_mesh, refuse_padding
from hf_longctx.integrations.patch_state import PatchState


def _consistency_check(info: SPBatchInfo, num_items, s_local: int, device, mesh: SPMesh, *, first: bool) -> None:
    """All SP ranks must hold shards of the SAME batch (invariant 3). One tiny all_gather per
    micro-batch; every rank sees the same gathered rows, so all raise together (no hang).
    `first` (the first micro-batch of this patch) or a CPU table: the table is read on the
    host and the error names every rank's values. Later micro-batches on a GPU never block
    the host: the comparison stays on the device and `torch._assert_async` raises from there
    (a device-side assert, reported at the next synchronisation)."""
    import torch.distributed as dist

    cu_hash = 0
    for i, c in enumerate(info.cu_seqlens):
        cu_hash = (cu_hash * 1_000_003 + c * (i + 1)) % 2_147_483_647
    from hf_longctx.distributed.loss import collective_device
    from hf_longctx.devices import upload

    # The batch's device when it is a GPU one; else the group's (NCCL refuses CPU tensors).
    device = collective_device(mesh.sp_group, device)
    on_device = isinstance(num_items, torch.Tensor) and num_items.device.type != "cpu"  # int() would sync
    n = -1 if num_items is None or on_device else int(num_items)
    sig = upload(torch.tensor([info.fingerprint, cu_hash, n, s_local, info.rows], dtype=torch.long), device)  # [5]
    if on_device:
        sig[2] = num_items.to(device=device, dtype=torch.long).reshape(())  # a device copy, no host read
    rows = [torch.empty_like(sig) for _ in range(mesh.sp)]
    dist.all_gather(rows, sig, group=mesh.sp_group)  # [SP] x [5]
    table = torch.stack(rows)  # [SP, 5]
    why = (
        "the ranks of one SP group hold shards of DIFFERENT batches (per-rank [fingerprint, boundaries, "
        "num_items_in_batch, S_local, B] = {}); every rank of an SP group must call shard_batch on the same batch -- "
        "seed the sampler by DP rank, not by global rank"
    )
    if not first and table.device.type != "cpu":  # on CPU reading the table costs no device sync
        torch._assert_async((table == table[0]).all(), why.format("not read, to keep the host free"))
        return
    table = table.cpu()
    if not bool((table == table[0]).all()):
        raise ValueError(why.format(table.tolist()))


def takes_use_cache(hf) -> bool:
    """Whether `use_cache=False` can be passed to `hf`'s forward: a parameter of its own, or its
    **kwargs reach an inner model that takes it (image-text-to-text wrappers: the language model
    otherwise defaults to `config.use_cache` and fills a DynamicCache in training)."""
    from transformers import PreTrainedModel

    params = inspect.signature(hf.forward).parameters
    if "use_cache" in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    return any("use_cache" in inspect.signature(m.forward).parameters
               for m in hf.modules() if m is not hf and isinstance(m, PreTrainedModel))


def pre_forward_hook(state: PatchState, hf) -> Callable:
    accepts_cache = takes_use_cache(hf)
    names = list(inspect.signature(hf.forward).parameters)
    mask_at = names.index("attention_mask") if "attention_mask" in names else None  # passed by position too

    def hook(module, args, kwargs):
        generation = state.generation
        if generation is not None and generation.decoding:  # a rollout's decode step: rows, not a shard
            if accepts_cache:
                kwargs["use_cache"] = False
            state.calls = 0
            state.plan_cache.clear()
            return args, kwargs
        if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None:
            raise ValueError(
                "a sequence-parallel forward cannot use a KV cache (use_cache=True / past_key_values); pass "
                "use_cache=False, and call hf_longctx.unpatch(model) before generate()"
            )
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions=True is not supported under sequence parallelism")
        if kwargs.get("output_router_logits"):
            raise ValueError(
                "output_router_logits=True under sequence parallelism: the MoE load-balancing loss would be computed per "
                "shard and differ from the single-device one; pass output_router_logits=False"
            )
        if accepts_cache:
            kwargs["use_cache"] = False
        mask = kwargs.get("attention_mask")
        if mask is None and mask_at is not None and len(args) > mask_at:
            mask = args[mask_at]
        refuse_padding(mask, read=not state.checked)
        info = kwargs.get(SP_METADATA_KEY)
        if not isinstance(info, SPBatchInfo):
            raise ValueError(
                f"the patched model needs the '{SP_METADATA_KEY}' entry of hf_longctx.shard_batch(batch, mesh): call "
                "model(**shard_batch(batch, mesh)); for plain single-device use call hf_longctx.unpatch(model) first"
            )
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        if ref is None:
            raise ValueError("the patched model needs input_ids or inputs_embeds")
        mesh = batch_mesh(state, info)  # the batch's own group (a GroupBank patch), else the patch-time mesh
        if mesh.sp > 1:
            _consistency_check(info, kwargs.get("num_items_in_batch"), ref.shape[1], ref.device, mesh, first=not state.checked)
            state.checked = True
        state.calls = 0
        state.mask_windows.clear()  # filled by the mask function as the model builds this forward's masks
        if state.mixers is not None:
            state.mixers.begin(info)  # the linear-mixer wrappers read the batch layout from here
        state.plan_cache.clear()  # bounds it to one batch; entries are keyed, so a recompute is only a miss
        return args, kwargs

    return torch.compiler.disable(hook)  # checks and a collective per batch: never traced by torch.compile


def post_forward_hook(state: PatchState) -> Callable:
    def hook(module, args, kwargs, output):
        if state.probe is not None and state.calls != state.probe.attention_calls:
            raise RuntimeError(
                f"this forward made {state.calls} sequence-parallel attention calls, but the dry run at patch() made "
                f"{state.probe.attention_calls}: the model takes a different path at run time than on the probe (inputs it "
                "was not probed with, e.g. inputs_embeds or extra modalities), and exactness was only proven for that "
                "path; call the patched model with input_ids/labels from shard_batch only"
            )
        if state.mixers is not None:
            state.mixers.check_calls()
        return output

    return torch.compiler.disable(hook)
