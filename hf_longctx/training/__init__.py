"""Training through `transformers.Trainer` (and TRL's `SFTTrainer`): what only hf_longctx does.

Where it sits: on top of the whole library. `trainer.py` is the `LongContextTrainerMixin`
(exact SP arithmetic under Trainer); `sft/data.py` its step dataloader (step sampler →
cost-balanced plan → sharded micro-batches); `refusals/checks.py` the refused settings;
`base/saving.py` the sharded model/optimizer states and sampler position of `checkpoint-N/`;
`metrics.py` / `token_metrics.py` what it logs; `faults.py` the dead-rank stop; `launch.py`
the device and process group of a recipe; `dpo/trainer.py` / `dpo/data.py` the
`LongDPOTrainer` over TRL's `DPOTrainer` (preference pairs as the step unit). Schedules, checkpoint bookkeeping, progress bars
and config parsing are the Trainer's. The trainer classes are imported lazily
(`hf_longctx.training.sft.trainer`): importing them loads `transformers.Trainer`.
"""

from hf_longctx.training.base.faults import RankFailure, Watchdog, comm_guard
from hf_longctx.training.launch import describe, exit_rank, init_distributed, run_rank

__all__ = ["RankFailure", "Watchdog", "comm_guard", "describe", "exit_rank", "init_distributed", "run_rank"]
