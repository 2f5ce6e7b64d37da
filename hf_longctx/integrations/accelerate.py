"""The FSDP2 plan: ZeRO-3 over the whole DP × SP world (USP paper "Tip 3", FPDT §3.2).

Where it sits: after `from_pretrained` and `patch()`, before the optimizer is built. Every
rank of an SP group holds the SAME parameters, so parameters, gradients and optimizer
states shard over the whole world, which Accelerate's `ParallelismConfig` cannot describe.
`fsdp_plan()` returns `apply(model)` (torch `fully_shard` per decoder layer, on the
embedding and LM head -- one unit when tied -- then the root; the path every loop uses),
`device_mesh` (the 1-D world mesh), an equivalent Accelerate `plugin` (then call
`plan.sum_reduction(model)`), and `gradient_reduction = "sum"` (invariant 6).
Guarantees: gradients are SUMMED, never averaged; `apply` never moves the whole model, so at
most one unsharded unit is on the device at load. Why: docs/DESIGN.md "Decisions and why"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from hf_longctx._compat import fsdp_reduces_unused_params
from hf_longctx.distributed.mesh import SPMesh, one_rank_world
from hf_longctx.errors import NotSupported
from hf_longctx.integrations.fsdp_units import embedding_units, plan_units, split_parameters
from hf_longctx.integrations.unused_params import reduce_unused_params
from hf_longctx.model_walk import decoder_layer_classes

MIXED_PRECISION = ("bf16", "fp32")


@dataclass(frozen=True)
class FSDPPlan:
    """How one model is sharded; build it with `fsdp_plan()`, apply it with `plan.apply(model)`.

    Attributes:
        plugin: The `accelerate.FullyShardedDataParallelPlugin` (fsdp_version=2) of the plan.
        device_mesh: The 1-D `DeviceMesh` over the whole DP × SP world; None in one process
            without parameter offload.
        layer_classes: The module classes sharded as one unit each (the decoder layers).
        mixed_precision: "bf16" or "fp32".
        param_offload: Sharded parameters, gradients and optimizer states in host memory.
        reshard_after_forward: Free each layer's gathered parameters after its forward.
        gradient_reduction: Always "sum": FSDP's reduce-scatter sums (invariant 6).
    """

    plugin: Any  # accelerate.FullyShardedDataParallelPlugin (fsdp_version=2)
    device_mesh: Any  # 1-D DeviceMesh over the whole DP × SP world; None in one process without param_offload
    layer_classes: tuple[type, ...]
    mixed_precision: str
    param_offload: bool
    reshard_after_forward: bool = True
    gradient_reduction: Literal["sum"] = "sum"

    @property
    def gradient_divide_factor(self) -> float:
        """1.0: FSDP's reduce-scatter sums (invariant 6)."""
        return 1.0

    def _policies(self) -> tuple[Any, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        if self.mixed_precision == "bf16":
            # bf16 compute and all-gathers, fp32 gradient reduction: the sum of many ranks'
            # shares must not be rounded to 8 mantissa bits at every partial sum.
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        if not self.param_offload:
            return mp, OffloadPolicy()
        # Pinned host memory only helps (and only exists) with a CUDA device to copy to.
        return mp, CPUOffloadPolicy(pin_memory=torch.cuda.is_available())

    def sum_reduction(self, model: torch.nn.Module) -> int:
        """Make every FSDP unit in `model` SUM its gradients; returns how many units.

        `set_gradient_divide_factor(1.0)` alone would ask NCCL for PREMUL_SUM, which gloo
        lacks; forcing sum-type comms makes the reduce-scatter a plain SUM (then a division
        by 1.0, which is exact) on both backends.
        """
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in units:
            m.set_gradient_divide_factor(self.gradient_divide_factor)
            m.set_force_sum_reduction_for_comms(True)
            # An MoE expert that got no token of this rank's shard has no gradient here but one
            # on its peers: FSDP2 would leave it out of this rank's reduce-scatter only, and the
            # ranks' collectives would disagree (a mismatch on gloo, a hang or a wrong sum on
            # NCCL). Unused trainable parameters join with zeros instead.
            if fsdp_reduces_unused_params():
                m.set_reduce_scatter_unused_params(True, recurse=False)
            else:  # torch 2.11 floor: zero gradients from a forward hook (see unused_params.py)
                reduce_unused_params(m)
        return len(units)

    def apply(self, model: torch.nn.Module, *, broadcast_from_rank0: bool = False) -> torch.nn.Module:
        """Shard `model` in place with torch `fully_shard` (layers first, then the vocabulary
        units, then the root) and return it. In one process without `param_offload` (no mesh)
        there is nothing to shard: the model is returned as is; with it, the units are sharded
        over one rank so that FSDP2 keeps them in host memory.

        `broadcast_from_rank0=True`: only global rank 0 loaded the weights; every other rank
        built the model on the meta device (`with torch.device("meta"): from_config(...)`),
        so host memory holds ONE full copy per job instead of one per rank. After sharding,
        the meta ranks allocate their shards (`to_empty`) and rank 0's full state dict is
        broadcast with `set_model_state_dict(..., StateDictOptions(full_state_dict=True,
        broadcast_from_rank0=True))`; every buffer (non-persistent ones such as RoPE's
        inv_freq are in no state dict) is broadcast from rank 0 too."""
        if self.device_mesh is None:
            return model
        full_state = self._rank0_state(model) if broadcast_from_rank0 else None
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} is already sharded with fully_shard; apply the plan once")
        mp, offload = self._policies()
        kw = dict(mesh=self.device_mesh, mp_policy=mp, offload_policy=offload)
        layers = [m for m in model.modules() if isinstance(m, self.layer_classes)]
        if not layers:
            raise ValueError(f"no module of classes {[c.__name__ for c in self.layer_classes]} in {type(model).__name__}")
        split = split_parameters(model, plan_units(model, self.layer_classes))  # before any unit (and collective)
        if split:
            raise NotSupported(
                f"cannot shard {type(model).__name__} with FSDP2:\n- " + "\n- ".join(split),
                "train a model whose parameters are not shared between decoder layers or heads (only the input "
                "embedding and the LM head may share their weight); or, where the whole model fits every device, "
                "skip fsdp_plan and sum the gradients in your own loop (hf_longctx.sum_gradients(model.parameters(), mesh))",
            )
        # No model.to(device): fully_shard moves each unit's states itself (module docstring).
        for layer in layers:
            fully_shard(layer, reshard_after_forward=self.reshard_after_forward, **kw)
        for unit in embedding_units(model):
            # Always resharded after use: the LM head runs last in forward and first in
            # backward (one extra all-gather), the embedding first and last.
            fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=True, **kw)
        # What is left to the root (final norm, position embeddings, buffers) is small; it is
        # needed first in backward, so it stays unsharded after forward.
        fully_shard(model, reshard_after_forward=False, **kw)
        if broadcast_from_rank0:
            self._broadcast_from_rank0(model, full_state)
        self.sum_reduction(model)
        return model

    def _rank0_state(self, model: torch.nn.Module) -> dict:
        """Rank 0's full state dict, taken before sharding; checks the other ranks are on meta."""
        import torch.distributed as dist

        rank = dist.get_rank()
        on_meta = [n for n, p in model.named_parameters() if p.is_meta]
        if rank == 0 and on_meta:
            raise ValueError(f"broadcast_from_rank0=True: rank 0 must hold the real weights, but {on_meta[:3]} are on meta")
        if rank != 0 and len(on_meta) != len(list(model.parameters())):
            raise ValueError(
                f"broadcast_from_rank0=True: rank {rank} should build the model on the meta device "
                "(with torch.device('meta'): AutoModelForCausalLM.from_config(config)); it holds real parameters"
            )
        return {k: v for k, v in model.state_dict().items()} if rank == 0 else {}

    def _broadcast_from_rank0(self, model: torch.nn.Module, full_state: dict) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # The mesh's device even with param_offload: fully_shard moved rank 0's buffers there
        # (torch's _move_states_to_device ignores the offload policy), so every rank's buffers
        # live there; FSDP moves offloaded parameter shards to host memory itself at lazy init.
        device = torch.device("cpu") if self.device_mesh.device_type == "cpu" else torch.device(
            self.device_mesh.device_type, torch.cuda.current_device()
        )
        if dist.get_rank() != 0:
            model.to_empty(device=device)  # this rank's shards (and buffers), uninitialised
        set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        group = self.device_mesh.get_group()
        for _, buf in model.named_buffers():
            moved = buf.to(device)
            dist.broadcast(moved, src=dist.get_global_rank(group, 0), group=group)  # [same shape] from rank 0
            if moved is not buf:
                buf.copy_(moved)


def _plugin(layer_classes: tuple[type, ...], mixed_precision: str, param_offload: bool, reshard_after_forward: bool):
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision == "bf16" else None
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=reshard_after_forward,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[c.__name__ for c in layer_classes],
        mixed_precision_policy=mp,
        cpu_offload=param_offload,
        activation_checkpointing=False,  # patch(checkpoint=True) owns recomputation
        state_dict_type="SHARDED_STATE_DICT",
    )


def _model_precision(model: Any) -> str:
    """"bf16" when the model's first floating-point parameter is bf16, else "fp32" (no cast)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def fsdp_plan(
    model: Any,
    mesh: SPMesh,
    *,
    mixed_precision: Literal["bf16", "fp32"] | None = None,
    param_offload: bool = False,
    reshard_after_forward: bool = True,
    layer_classes: tuple[type, ...] | None = None,
) -> FSDPPlan:
    """The FSDP2 plan of `model` over the whole world of `mesh` (ZeRO-3 over DP × SP).

    Call `plan.apply(model)` on every rank before building the optimizer.

    Args:
        model: The (patched) model.
        mesh: This rank's mesh; the plan shards over its whole world.
        mixed_precision: `"bf16"`: bf16 parameters in compute, fp32 master weights and fp32
            gradient reduction; `"fp32"` keeps the model's own dtype everywhere (no cast: an
            fp32 model computes in fp32). Default (None): follows the model -- "bf16" when
            its floating parameters are bf16, else "fp32" -- never a silent bf16 cast of an
            fp32 model.
        param_offload: Keep sharded parameters, gradients and optimizer states in host
            memory -- in one process too: FSDP2 over a one-rank world mesh
            (`one_rank_world`, which creates a one-rank process group when none exists),
            each unit copied to the device for its forward and backward only.
        reshard_after_forward: Free each layer's gathered parameters after its forward
            (gathered again for the backward).
        layer_classes: The module classes to shard as one unit each (default: the model's
            decoder layer classes).

    Returns:
        The plan.

    Raises:
        TypeError: `mesh` is not an `SPMesh`.
        ValueError: An unknown `mixed_precision`, or a multi-rank mesh without a world mesh.
    """
    if not isinstance(mesh, SPMesh):
        raise TypeError(f"mesh must be an SPMesh from hf_longctx.init_sequence_parallel, got {type(mesh).__name__}")
    if mixed_precision is None:
        mixed_precision = _model_precision(model)
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION} or None (follow the model's dtype), "
                         f"got {mixed_precision!r}")
    if mesh.world_size > 1 and mesh.world_mesh is None:
        raise ValueError(f"mesh of world size {mesh.world_size} has no world_mesh; build it with init_sequence_parallel")
    classes = tuple(layer_classes) if layer_classes else decoder_layer_classes(model)
    if mesh.world_size > 1:
        device_mesh = mesh.world_mesh
    else:  # one process: nothing to shard, unless the parameters go to host memory (FSDP2 over one rank)
        device_mesh = one_rank_world(mesh).world_mesh if param_offload else None
    return FSDPPlan(
        plugin=_plugin(classes, mixed_precision, bool(param_offload), bool(reshard_after_forward)),
        device_mesh=device_mesh,
        layer_classes=classes,
        mixed_precision=mixed_precision,
        param_offload=bool(param_offload),
        reshard_after_forward=bool(reshard_after_forward),
    )
