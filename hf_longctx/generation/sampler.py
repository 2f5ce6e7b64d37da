"""The next token of every row of a sequence-parallel rollout: each rank samples the rows it owns,
exactly as transformers' `generate` samples its batch, and the SP group shares the tokens.

Where it sits: `generation/loop.py` calls it after the prefill and after every decode step with
the logits of all rows (identical on every rank of the SP group: the merged attention and the
token-wise layers compute the same values everywhere). Seeding contract: the rows a rank owns are
one `generate` batch of that rank -- its processors see the same left-padded history
(prompt + tokens so far, pads ignored by the repetition penalty), it draws `torch.multinomial`
over the same [B_own, V] probabilities once per step while any of its rows is unfinished and
never after (as `generate` leaves its loop), and finished rows get the pad token. So a rank's
global RNG advances as in `generate` on that batch, and its draws equal it under the same seed
(the logits agree to fp32 rounding; a sample can differ only where that rounding crosses a
cumulative-probability boundary). The tokens then travel in one all-gather over the SP group per
step; every rank learns every row's token and which rows finished, so all agree on the loop."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hf_longctx.generation.settings import SamplingSettings, logits_processors


class OwnerSampler:
    """This rank's rows (`prompts`, in their order among the rollout's rows): history, processors,
    unfinished flags. `sample` is one iteration of `generate`'s sampling loop on them."""

    def __init__(self, settings: SamplingSettings, prompts: Sequence[Sequence[int]], device: torch.device) -> None:
        self.settings, self.device = settings, device
        width = max((len(p) for p in prompts), default=0)
        history = torch.full((len(prompts), width), settings.pad_token_id, dtype=torch.long)  # [B_own, P_max]
        for i, p in enumerate(prompts):
            history[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)  # left padding, as TRL pads prompts
        pad_lengths = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
        self.history = history.to(device)
        self.processors = logits_processors(settings, pad_lengths.to(device))
        self.unfinished = torch.ones(len(prompts), dtype=torch.long, device=device)  # [B_own]
        self.eos = torch.tensor(settings.eos_token_ids, dtype=torch.long, device=device)
        self.drawn = 0
        self.active = len(prompts) > 0  # generate's loop still runs for this batch

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B_own, V] float32 of this step -> tokens [B_own] (pads for finished rows; all pads,
        and no draw, once every own row finished)."""
        if not self.active:
            return torch.full((self.history.shape[0],), self.settings.pad_token_id, dtype=torch.long, device=self.device)
        scores = self.processors(self.history, logits)
        if self.settings.do_sample:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)  # [B_own]
        else:
            tokens = torch.argmax(scores, dim=-1)  # [B_own]
        if self.eos.numel():  # generate pads finished rows only when it stops on EOS
            tokens = tokens * self.unfinished + self.settings.pad_token_id * (1 - self.unfinished)
        self.history = torch.cat([self.history, tokens[:, None]], dim=-1)  # [B_own, P_max + drawn + 1]
        self.unfinished = self.unfinished & ~torch.isin(tokens, self.eos)
        self.drawn += 1
        return tokens

    def finish_step(self, own_unfinished: list[bool]) -> None:
        """The host's view after the step's all-gather: `generate` leaves its loop once no own row is
        unfinished or max_new_tokens tokens were drawn."""
        self.active = self.active and any(own_unfinished) and self.drawn < self.settings.max_new_tokens


def token_order(owners: Sequence[int], sp: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(int64 [N] on the device: where row n's token lies in the flattened [SP, B_max] all-gather of
    `share_tokens`, rows owned by a rank in row order; B_max, the largest rank's count)."""
    width = max([sum(1 for o in owners if o == r) for r in range(sp)] + [1])
    taken = [0] * sp
    flat = []
    for o in owners:
        flat.append(o * width + taken[o])
        taken[o] += 1
    return torch.tensor(flat, dtype=torch.long, device=device), width


def share_tokens(mine: torch.Tensor, order: torch.Tensor, width: int, mesh) -> tuple[torch.Tensor, list[int]]:
    """Every row's token of this step, on every rank of the SP group: (tokens [N] on the device -- the
    next decode step's input, never uploaded again -- and the same on the host). `mine` [B_own] holds
    this rank's rows' tokens (rows n with owners[n] == sp_rank, in row order); `order`, `width`: `token_order`.
    One all-gather over the SP group of [B_max]; the copy to the host is the step's one host read
    (the loop's stop decision needs it)."""
    if mesh.sp > 1:
        padded = torch.zeros(width, dtype=torch.long, device=mine.device)
        padded[: mine.numel()] = mine
        parts = [torch.empty_like(padded) for _ in range(mesh.sp)]
        dist.all_gather(parts, padded, group=mesh.sp_group)  # [SP] x [B_max]
        table = torch.cat(parts)  # [SP * B_max], rank-major
    else:
        table = mine
    tokens = table.index_select(0, order)  # [N], in row order
    return tokens, tokens.cpu().tolist()
