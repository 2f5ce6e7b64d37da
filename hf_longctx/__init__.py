"""hf_longctx: sequence-parallel long-context training for Hugging Face causal LMs.

Public API only. The data flow (DESIGN.md): a step sampler draws the same global list of
documents on every rank → `plan_microbatches` assigns them to DP ranks and micro-batches
by estimated cost → `shard_batch` (through the collator) shifts labels, pads and gathers
this SP rank's tokens → the `patch`ed model runs `usp_attention` (or FPDT) → the loss is
normalised by the global token count and gradients are summed over ranks.
`LongContextTrainer` / `LongContextTrainerMixin` run it through `transformers.Trainer`
(imported on first access: they load the Trainer). Vision-language models: `vision_spec(model)`,
then `shard_multimodal` / `MultimodalCollator` in place of `shard_batch` / `LongContextCollator`.
Rollouts: `sp_generate(model, prompts, mesh, max_new_tokens=..., ...)` decodes on the patched model
with the KV cache sharded over the SP group (`sampling_settings` resolves generate's options).
"""

from hf_longctx.data.collator import LongContextCollator
from hf_longctx.data.multimodal.collator import MultimodalCollator
from hf_longctx.data.multimodal.sharding import shard_multimodal
from hf_longctx.data.multimodal.spec import VisionCost, VisionSpec
from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.sp_groups import GroupShape, group_shapes
from hf_longctx.flex.packing import plan_fixed, plan_flexible
from hf_longctx.flex.unequal import plan_unequal
from hf_longctx.flex.plan import FlexGroup, FlexPlan
from hf_longctx.data.packing import plan_microbatches
from hf_longctx.data.pairs import pack_pairs, plan_pairs
from hf_longctx.data.plan import Piece, Plan
from hf_longctx.data.pipeline import tokenize_dataset
from hf_longctx.data.sampler import StepSampler, group_stream
from hf_longctx.data.sharding import shard_batch
from hf_longctx.distributed.doc_sums import doc_sums
from hf_longctx.distributed.gather import gather_sequence
from hf_longctx.flex.step import flex_microbatches, run_flex_step
from hf_longctx.flex.bank import GroupBank, init_group_bank
from hf_longctx.distributed.mesh import SPMesh, init_sequence_parallel
from hf_longctx.errors import NotSupported
from hf_longctx.integrations.accelerate import FSDPPlan, fsdp_plan
from hf_longctx.integrations.model_patch import is_patched, unpatch
from hf_longctx.integrations.parallelism_config import mesh_from_parallelism_config
from hf_longctx.integrations.vision.registry import vision_spec
from hf_longctx.distributed.loss import global_loss, sum_gradients
from hf_longctx.ops.fpdt import fpdt_attention
from hf_longctx.ops.usp import usp_attention
from hf_longctx.patching import patch
from hf_longctx.verify import VerificationError, verify

__all__ = [
    "CostModel",
    "FSDPPlan",
    "FlexGroup",
    "FlexPlan",
    "GroupBank",
    "GroupCost",
    "GroupShape",
    "LongContextCollator",
    "MultimodalCollator",
    "NotSupported",
    "Piece",
    "Plan",
    "SPMesh",
    "StepSampler",
    "VisionCost",
    "VisionSpec",
    "LongContextTrainer",
    "LongContextTrainerMixin",
    "LongDPOTrainer",
    "GRPOObjective",
    "LongGRPOTrainer",
    "LongRLOOTrainer",
    "flex_microbatches",
    "doc_sums",
    "exit_rank",
    "fpdt_attention",
    "fsdp_plan",
    "gather_sequence",
    "global_loss",
    "grpo_step",
    "group_shapes",
    "group_stream",
    "init_group_bank",
    "init_sequence_parallel",
    "is_patched",
    "mesh_from_parallelism_config",
    "pack_pairs",
    "patch",
    "plan_fixed",
    "plan_flexible",
    "plan_unequal",
    "plan_microbatches",
    "plan_pairs",
    "run_flex_step",
    "run_rank",
    "SamplingSettings",
    "sampling_settings",
    "sp_generate",
    "shard_batch",
    "shard_multimodal",
    "sum_gradients",
    "tokenize_dataset",
    "unpatch",
    "usp_attention",
    "verify",
    "VerificationError",
    "vision_spec",
]


def __getattr__(name: str):
    if name in ("LongContextTrainer", "LongContextTrainerMixin"):
        from hf_longctx.training.sft import trainer

        return getattr(trainer, name)
    if name == "LongDPOTrainer":  # imports TRL (training/dpo/trainer.py)
        from hf_longctx.training.dpo.trainer import LongDPOTrainer

        return LongDPOTrainer
    if name in ("GRPOObjective", "grpo_step"):  # the GRPO step (training/grpo/step.py), imported on first access
        from hf_longctx.training.grpo import step as grpo
        from hf_longctx.training.grpo import loss as grpo_loss

        return getattr(grpo_loss if name == "GRPOObjective" else grpo, name)
    if name == "LongGRPOTrainer":  # TRL's GRPOTrainer under SP (training/grpo/trainer.py): imports trl
        from hf_longctx.training.grpo import trainer as grpo_trainer

        return grpo_trainer.LongGRPOTrainer
    if name == "LongRLOOTrainer":  # TRL's RLOOTrainer under SP (training/rloo/trainer.py): imports trl
        from hf_longctx.training.rloo.trainer import LongRLOOTrainer

        return LongRLOOTrainer
    if name in ("sp_generate", "sampling_settings", "SamplingSettings"):  # generation/, imported on first access
        from hf_longctx.generation import loop, settings

        return getattr(loop if name == "sp_generate" else settings, name)
    if name in ("exit_rank", "run_rank"):  # a launched rank's clean end (training/launch.py)
        from hf_longctx.training import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'hf_longctx' has no attribute {name!r}")
