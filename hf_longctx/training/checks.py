"""Refusals: `TrainingArguments` (and TRL `SFTConfig`) settings that would silently break the
exact-loss contract of `LongContextTrainerMixin`, or be silently ignored by it.

Where it sits: the first thing the trainer's `__init__` runs, on every rank alike and
before any collective, so a bad setting is one clear `ValueError` everywhere instead of a
hang or a wrong gradient. The contract (DESIGN invariant 6): every rank's loss is its token-
loss sum divided by the step's GLOBAL target count, micro-batch and rank gradients are
SUMMED; one optimizer step = one planned step of `tokens_per_step` tokens.
"""

from __future__ import annotations

from typing import Any

_DEFAULT_PER_DEVICE_BATCH = 8  # TrainingArguments' default; any other value would be ignored


def _trl_refusals(args: Any) -> list[str]:
    errors = []
    if not hasattr(args, "packing"):  # not an SFTConfig
        return errors
    if getattr(args, "max_length", None) is not None:
        errors.append(
            f"SFTConfig.max_length={args.max_length}: TRL would truncate every longer document silently; "
            "pass max_length=None (the cap is the trainer's max_tokens, and overlong= decides what happens above it)"
        )
    if args.packing or getattr(args, "padding_free", False):
        errors.append(
            f"SFTConfig.packing={args.packing} / padding_free={getattr(args, 'padding_free', False)}: hf_longctx's "
            "planner packs documents itself (cost-balanced, per-document attention); set both to False"
        )
    if getattr(args, "loss_type", "nll") != "nll":
        errors.append(f"SFTConfig.loss_type={args.loss_type!r}: only 'nll' (the model's token loss) is exact under SP")
    if getattr(args, "activation_offloading", False):
        errors.append("SFTConfig.activation_offloading=True: use patch(model, mesh, kv_offload=True / checkpoint=True)")
    return errors


def check_training_arguments(args: Any) -> None:
    """Raise one ValueError listing every refused setting of `args`, with why and what to use."""
    errors = []
    if args.gradient_accumulation_steps != 1:
        errors.append(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: one optimizer step is one planned step "
            "whose micro-batch count the planner chooses; set tokens_per_step for a larger batch"
        )
    pc = getattr(args, "parallelism_config", None)
    if pc is not None and (getattr(pc, "sp_size", 1) > 1 or getattr(pc, "cp_size", 1) > 1):
        errors.append(
            f"parallelism_config with sp_size={getattr(pc, 'sp_size', 1)}, cp_size={getattr(pc, 'cp_size', 1)}: "
            "sequence parallelism comes from the mesh (init_sequence_parallel) and patch(); drop it"
        )
    if args.label_smoothing_factor > 0:
        errors.append(
            f"label_smoothing_factor={args.label_smoothing_factor}: the loss must be the model's token NLL normalised "
            "by the global target count"
        )
    if args.use_liger_kernel:
        errors.append("use_liger_kernel=True: Liger replaces the model's forward and loss; use patch(..., loss_chunks=N)")
    if args.train_sampling_strategy != "random":
        errors.append(
            f"train_sampling_strategy={args.train_sampling_strategy!r}: the step sampler draws documents "
            "(seeded by args.seed); shuffling is built in"
        )
    if args.per_device_train_batch_size != _DEFAULT_PER_DEVICE_BATCH:
        errors.append(
            f"per_device_train_batch_size={args.per_device_train_batch_size}: the batch is tokens_per_step global "
            "tokens per optimizer step (and max_tokens per micro-batch); leave it at its default"
        )
    if args.torch_compile:
        errors.append("torch_compile=True: not tested with the patched attention; leave it False")
    if args.fp16:
        errors.append("fp16=True: the attention kernels refuse fp16; use bf16=True")
    if args.fsdp or args.deepspeed:
        errors.append(
            "fsdp/deepspeed set: hf_longctx shards the model itself with FSDP2 over the whole DP x SP world "
            "(fsdp_plan); drop these settings"
        )
    if args.dataloader_num_workers:
        errors.append(
            f"dataloader_num_workers={args.dataloader_num_workers}: the step sampler's checkpointed position must "
            "equal the steps consumed, and workers prefetch; planning a step costs milliseconds, use 0"
        )
    if args.n_gpu > 1:
        errors.append(f"n_gpu={args.n_gpu} (nn.DataParallel): launch one process per device (torchrun / accelerate launch)")
    errors += _trl_refusals(args)
    if errors:
        raise ValueError("LongContextTrainer cannot honour these TrainingArguments:\n- " + "\n- ".join(errors))


def check_process_group(args: Any) -> None:
    """TrainingArguments must see the process group the mesh was built on."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if args.world_size != world or (world > 1 and args.process_index != dist.get_rank()):
        raise ValueError(
            f"TrainingArguments see world_size={args.world_size} (process {args.process_index}) but torch.distributed "
            f"has {world} rank(s): Accelerate reads the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
            "LOCAL_WORLD_SIZE); launch with torchrun / accelerate launch, or, for a process group you initialised "
            "yourself, set those variables before creating TrainingArguments (on CPU also use_cpu=True)"
        )
