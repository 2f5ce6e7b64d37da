"""Every version and kernel probe of the project, in one place.

Where it sits: below everything. `ops/backends/select.py` asks which local attention
kernels exist (aten CPU flash op, flash-attn 2.x, torch's own CUDA flash kernels, the
FA3/FA4 implementations torch can switch to, cuDNN through torch's ops and through
nvidia-cudnn-frontend); integrations ask for library versions and the GPU's name.
Probes of the installed software and hardware are pure (same answer for the life of the
process), so the slow ones are `functools.cache`d: the first attention call pays for an
import, later tiles pay nothing. No module state of our own, no environment flags.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import warnings

import torch


def package_version(name: str) -> tuple[int, ...] | None:
    """Numeric release tuple of an installed distribution, or None if not installed."""
    try:
        text = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return parse_version(text)


def parse_version(text: str) -> tuple[int, ...]:
    """"2.7.4.post1" -> (2, 7, 4); "2.8.0+cu12torch2.6" -> (2, 8, 0)."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def torch_version() -> tuple[int, ...]:
    return package_version("torch") or tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@functools.cache
def has_cpu_flash_op() -> bool:
    """torch ships the CPU flash-attention op pair that returns the log-sum-exp."""
    ops = torch.ops.aten
    return hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        ops, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def empty_host_cache() -> None:
    """Free the unused pinned blocks torch's caching host allocator keeps. Newer torch has
    `torch.accelerator.empty_host_cache`; torch 2.11 (the floor) has only the CUDA
    allocator's `torch._C._host_emptyCache` (the former raised AttributeError on an H100
    with torch 2.11+cu130). A no-op where neither exists or no accelerator is present."""
    if not torch.accelerator.is_available():  # both raise on a machine with no accelerator
        return
    fn = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


@functools.cache
def cuda_capability(index: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device `index`."""
    return torch.cuda.get_device_capability(index)


@functools.cache
def cuda_device_name(index: int) -> str:
    """The name CUDA reports for device `index` ("NVIDIA H100 80GB HBM3")."""
    return torch.cuda.get_device_name(index)


@functools.cache
def has_torch_cuda_flash() -> bool:
    """This torch build has its CUDA flash kernels (`aten::_flash_attention_forward` with
    cumulative lengths and windows, and its backward)."""
    if not torch.cuda.is_available():
        return False
    available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(available and available()) and hasattr(torch.ops.aten, "_flash_attention_backward")


@functools.cache
def flash_attn_modules():
    """(version string, flash_attn.flash_attn_interface, torch.ops.flash_attn or None) of
    an importable flash-attn, or None. Importing it needs CUDA libraries, hence the cache."""
    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError as exc:
        warnings.warn(f"hf_longctx: flash-attn is installed but does not import ({exc}); not using it", stacklevel=2)
        return None
    ops = getattr(torch.ops, "flash_attn", None)  # >= 2.7 registers its kernels as torch custom ops
    return getattr(flash_attn, "__version__", None), flash_attn_interface, ops


def cudnn_version() -> int | None:
    """The cuDNN runtime torch loaded, as one integer (9.14.0 -> 91400), or None without cuDNN."""
    if not torch.backends.cudnn.is_available():
        return None
    return torch.backends.cudnn.version()


def cudnn_attention_enabled() -> bool:
    """The user's switch for cuDNN attention (`torch.backends.cuda.enable_cudnn_sdp`): read per
    call, never set here."""
    enabled = getattr(torch.backends.cuda, "cudnn_sdp_enabled", None)
    return bool(enabled()) if enabled is not None else True


@functools.cache
def cudnn_frontend_ops():
    """(version string, torch.ops.cudnn) of an importable nvidia-cudnn-frontend whose SDPA torch
    ops are registered (`cudnn.sdpa.fwd.torch_op` registers `cudnn::sdpa_fwd` / `sdpa_bwd` on
    import), or None. Importing it loads cuDNN, hence CUDA only and the cache."""
    if not torch.cuda.is_available() or importlib.util.find_spec("cudnn") is None:
        return None
    try:
        importlib.import_module("cudnn.sdpa.fwd.torch_op")
    except Exception as exc:  # a native library or a dependency missing: the backend is absent, and says why
        warnings.warn(f"hf_longctx: nvidia-cudnn-frontend is installed but its SDPA ops do not load ({exc})", stacklevel=2)
        return None
    return package_version_text("nvidia-cudnn-frontend"), torch.ops.cudnn


def package_version_text(name: str) -> str | None:
    """The installed version string of distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _imports(package: str, module: str) -> bool:
    """Whether `package` is installed and its `module` imports (transformers falls back to its
    torch path on any import failure of a kernel package, so any failure counts as absent)."""
    if importlib.util.find_spec(package) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


@functools.cache
def fla_gated_delta_rule() -> bool:
    """flash-linear-attention's `chunk_gated_delta_rule` imports -- the condition under which
    transformers' module-level `torch_chunk_gated_delta_rule` (its hub-kernel fallback
    decorator) IS that kernel, which takes `cu_seqlens` (the torch fallback refuses them)."""
    return _imports("fla", "fla.ops.gated_delta_rule")


@functools.cache
def mamba_ssm_chunk_scan() -> bool:
    """mamba_ssm's `mamba_chunk_scan_combined` imports -- the condition under which transformers'
    module-level `mamba2_chunk_scan` (its hub-kernel fallback decorator) IS that kernel, which
    takes `seq_idx` (the torch fallback refuses it)."""
    return _imports("mamba_ssm", "mamba_ssm.ops.triton.ssd_combined")


def torch_flash_impl() -> str | None:
    """The flash implementation torch's CUDA flash ops run: "FA4" / "FA3" when the user
    activated one (`torch.nn.attention.activate_flash_attention_impl("FA3")` -- process-wide
    by torch's design, so it is the user's choice and never made here), None for torch's
    built-in FA2 or a torch without the switch. Read only."""
    attention = importlib.import_module("torch.nn.attention")
    current = getattr(attention, "current_flash_attention_impl", None)
    return current() if current is not None else None


@functools.cache
def gemm_accumulates_in_fp32(device_type: str, operand: torch.dtype, acc: torch.dtype) -> bool:
    """A GEMM of fp16/bf16 operands can add into an fp32 tensor as its output (cuBLAS's fp32 C
    with beta 1): torch's CUDA `baddbmm.dtype_out` (`out_dtype=float32`), whose kernel scales
    and adds into `out` itself (checked on an H200 with torch 2.11, the floor: in place, 2.7e-6
    from float64 for bf16 operands, beta 0 ignores NaN in `out`). Not `addmm.dtype_out`: torch's
    source asks `self` in the operands' dtype there and copies it into `out` first (2.11 took an
    fp32 `self`). CPU has neither kernel (NotImplementedError on the CPU backend, torch 2.13)."""
    return (device_type == "cuda" and acc == torch.float32 and operand in (torch.float16, torch.bfloat16)
            and hasattr(torch.ops.aten.baddbmm, "dtype_out"))


def fsdp_reduces_unused_params() -> bool:
    """torch's FSDP2 can put parameters without a gradient into its reduce-scatter as
    zeros (`FSDPModule.set_reduce_scatter_unused_params`): present in torch 2.13, absent in
    torch 2.11 (the floor), where `integrations/unused_params.py` stands in."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def checkpointing_fields(args) -> tuple[str, ...]:
    """The TrainingArguments fields that turn on HF's own activation checkpointing:
    transformers >= 5.18 has `activation_checkpointing` and `gradient_checkpointing` (its
    deprecated alias); 5.17 (the floor) only `gradient_checkpointing`."""
    return tuple(f for f in ("activation_checkpointing", "gradient_checkpointing") if hasattr(args, f))


TRAINER_SHARDED_MODELS = (5, 19)


def trainer_takes_sharded_models() -> bool:
    """transformers' Trainer has the path for a model that owns its placement and gradient
    reduction (`is_distributed_loading_by_transformers`: `accelerator.prepare_model(model,
    device_placement=False, evaluation_mode=True)`, autocast only), added in 5.19. Before it
    (5.17, 5.18) Accelerate wraps an FSDP2-sharded model in DDP on several ranks, which fails
    on its DTensor parameters ("mixed torch.Tensor and DTensor")."""
    return (package_version("transformers") or (0,)) >= TRAINER_SHARDED_MODELS


def fsdp_param_groups(unit) -> list:
    """FSDP2's parameter groups of one unit (torch keeps no public accessor; empty for a unit
    without parameters of its own): `FSDPState._fsdp_param_groups` (a list) in torch 2.13,
    `_fsdp_param_group` (one or None) in torch 2.11."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def generation_defaults() -> dict:
    """transformers' global generation defaults, what `generate` uses for a field neither the
    caller nor the model's generation config sets (e.g. top_k 50): `GenerationConfig.
    _get_default_generation_params()` where this release has it, else the 4.x defaults it replaced
    (they were the GenerationConfig() field values)."""
    from transformers import GenerationConfig

    probe = getattr(GenerationConfig, "_get_default_generation_params", None)
    if probe is not None:
        return dict(probe())
    return dict(temperature=1.0, top_k=50, top_p=1.0, repetition_penalty=1.0, num_beams=1, do_sample=False)


def repetition_penalty_skips_padding() -> bool:
    """transformers' `RepetitionPenaltyLogitsProcessor` takes a per-row `prompt_ignore_length`
    tensor, and `generate` passes each row's left padding through it, so pad tokens are not
    penalised (transformers 5.25); before (5.19, the floor) it takes an int only and `generate`
    penalises the left padding with the rest of the history. Probed by constructing one."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    try:
        RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.zeros(1, dtype=torch.long))
    except ValueError:  # "`prompt_ignore_length` has to be a positive integer"
        return False
    return True
