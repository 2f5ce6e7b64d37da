"""The shared training loop of the recipes and what it is made of.

Where it sits: on top of the whole library -- `loop.py` drives the step sampler, the
long-context collator, the patched model and the FSDP2 plan (ZeRO-3 over DP × SP, USP
"Tip 3"); `checkpoint.py` saves and resumes it exactly; `progress.py` reports loss,
tokens/s, MFU and memory; `faults.py` turns a dead or hung rank into a clear error.
"""

from hf_longctx.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from hf_longctx.training.faults import RankFailure, Watchdog, comm_guard, process_group_kwargs
from hf_longctx.training.launch import describe, setup_distributed
from hf_longctx.training.loop import StepRecord, TrainConfig, TrainResult, train
from hf_longctx.training.progress import Progress, peak_memory_bytes
from hf_longctx.training.schedule import cosine_schedule

__all__ = [
    "Progress",
    "RankFailure",
    "StepRecord",
    "TrainConfig",
    "TrainResult",
    "Watchdog",
    "comm_guard",
    "cosine_schedule",
    "describe",
    "latest_checkpoint",
    "load_checkpoint",
    "peak_memory_bytes",
    "process_group_kwargs",
    "save_checkpoint",
    "setup_distributed",
    "train",
]
