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

    def __init__(self) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64)
        self.seen = False

    @torch.no_grad()
    def add(self, logits: torch.Tensor | None, shift_labels: torch.Tensor) -> None:
        if logits is None:
            return
        valid = shift_labels != IGNORE_INDEX  # [B, S_local]
        lg = logits.detach()[valid].float()  # [n, V]: only the targets count
        target = shift_labels[valid]  # [n]
        logp = torch.log_softmax(lg, dim=-1)  # [n, V]
        entropy = -(logp.exp() * logp).sum(-1)  # [n]
        correct = (lg.argmax(-1) == target).sum()
        self.sums += torch.stack([correct.double(), entropy.double().sum(), valid.sum().double()]).cpu()
        self.seen = True

    def flush(self, device: torch.device) -> tuple[float, float] | None:
        """(entropy, accuracy) over every rank since the last flush; None without logits. A collective
        when a process group exists (every rank calls it, the same number of times)."""
        import torch.distributed as dist

        seen = torch.tensor([1.0 if self.seen else 0.0, *self.sums.tolist()], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(seen)  # [4]: ranks with logits, correct, entropy sum, valid -- summed over the world
        self.sums.zero_()
        self.seen = False
        if seen[0] == 0 or seen[3] == 0:
            return None
        return float(seen[2] / seen[3]), float(seen[1] / seen[3])
