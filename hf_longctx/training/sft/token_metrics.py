"""TRL's per-token metrics (`entropy`, `mean_token_accuracy`, `num_tokens`), exact under SP.

Where it sits: `LongContextTrainerMixin.compute_loss` adds every micro-batch's sums here
when the trainer keeps TRL's `_metrics` (an `SFTTrainer` subclass) and the model returned
logits; the step (or the whole evaluation) then sums them over every rank -- each token
lives on exactly one rank of the DP x SP world after `shard_batch` -- and divides by the
global count of valid targets. TRL itself averages per-rank means gathered per micro-batch;
with unequal shards that weights tokens unequally. With `patch(..., loss_chunks=N)` the
model returns no logits, so these two metrics are not logged (`num_tokens` still is).
"""

from __future__ import annotations

import torch

from hf_longctx.data.sharding import IGNORE_INDEX


class TokenStats:
    """Running [correct, entropy sum, valid targets] of this rank, float64."""

    ROWS = 1024  # target rows converted to fp32 at a time: [ROWS, V] transients, not [n, V]

    def __init__(self) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64)
        self.seen = False

    @torch.no_grad()
    def add(self, logits: torch.Tensor | None, shift_labels: torch.Tensor) -> None:
        from trl.trainer.utils import entropy_from_logits  # TRL's own (chunked) entropy; this runs under TRL only

        if logits is None:
            return
        valid = shift_labels != IGNORE_INDEX  # [B, S_local]
        lg = logits.detach()[valid]  # [n, V] in the model's dtype: only the targets count
        target = shift_labels[valid]  # [n]
        entropy = sum((entropy_from_logits(c.float()).double().sum() for c in lg.split(self.ROWS)),
                      torch.zeros((), dtype=torch.float64, device=lg.device))
        correct = (lg.argmax(-1) == target).sum()
        self.sums = self.sums.to(lg.device)  # stays on the device: no host sync per micro-batch
        self.sums += torch.stack([correct.double(), entropy, valid.sum().double()])
        self.seen = True

    def flush(self, device: torch.device) -> tuple[float, float] | None:
        """(entropy, accuracy) over every rank since the last flush; None without logits. A collective
        when a process group exists (every rank calls it, the same number of times)."""
        import torch.distributed as dist

        seen = torch.cat([torch.tensor([1.0 if self.seen else 0.0], dtype=torch.float64), self.sums.cpu()]).to(device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(seen)  # [4]: ranks with logits, correct, entropy sum, valid -- summed over the world
        self.sums.zero_()
        self.seen = False
        if seen[0] == 0 or seen[3] == 0:
            return None
        return float(seen[2] / seen[3]), float(seen[1] / seen[3])
