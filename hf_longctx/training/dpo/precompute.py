"""TRL's `precompute_ref_log_probs=True` under sequence parallelism: one reference pass over a
whole dataset before training, its per-pair sums stored as TRL's dataset columns.

Where it sits: at `LongDPOTrainer` construction (train and eval datasets) and `evaluate(
eval_dataset=...)`, in place of TRL's `_precompute_ref_logps` (which runs unsharded padded
rows). The pass plans and packs the pairs exactly as a training step does (`PairStepCollate`:
same mesh, `max_tokens`, planner, memory options), runs the reference under no_grad through
the chunked LM head on every slot of every rank (empty ones too: ZeRO-3 all-gathers per
unit), and sums each completion over the SP group (`completion_sums`). Guarantees: every rank
ends with the same fp32 [N] columns `ref_chosen_logps` / `ref_rejected_logps` (one DP
all-reduce), equal to TRL's; `with_ref_columns` stores them with their fingerprint (the
scored ids, the reference's digest, the sums sealed to both: `ref_fingerprint.py`), so a
dataset edited or reused with another reference is refused before any collective."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hf_longctx.data.sampler import StepSampler
from hf_longctx.devices import to_device
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.logprob_head import token_logprobs
from hf_longctx.training.base.step_data import FeatureRows
from hf_longctx.training.dpo.data import PAIR_COLUMNS, PAIRS_KEY
from hf_longctx.training.dpo.loss import completion_sums
from hf_longctx.training.dpo.ref_columns import FINGERPRINT, REF_COLUMNS
from hf_longctx.training.dpo.ref_fingerprint import fingerprint_columns

def reference_pass(reference: torch.nn.Module, dataset: Any, collate: Any, mesh: SPMesh, *, lengths: Sequence[int],
                   tokens_per_step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [N] chosen sums, fp32 [N] rejected sums) of `reference` over every pair of `dataset`
    (TRL's tokenized columns), identical on every rank. Steps of `tokens_per_step` pair tokens in
    dataset order, each planned and packed by `collate` (a `PairStepCollate`) as training does."""
    rows = FeatureRows(dataset, list(PAIR_COLUMNS), "precompute", "pair")
    sums = torch.zeros(len(dataset), 2, dtype=torch.float32, device=device)  # [N, (chosen, rejected)]
    was_training = reference.training
    reference.eval()
    try:
        with torch.no_grad():
            for indices in StepSampler(lengths, tokens_per_step=tokens_per_step, seed=0, shuffle=False):
                batch = collate(rows.__getitems__(indices))
                slots = batch.plan[mesh.dp_rank]  # this DP rank's micro-batches, in batch.micro_batches order
                for mb, inputs in zip(slots, batch.micro_batches):
                    inputs = to_device(inputs, device, pin=False)
                    shard = {k: v for k, v in inputs.items() if k != PAIRS_KEY}
                    token, _ = token_logprobs(reference, shard)  # [1, S_local] fp32
                    if hasattr(reference, "reshard"):  # FSDP2 keeps the root unsharded after forward
                        reference.reshard()
                    if not mb:  # an empty slot: the forward joined the collectives, nothing to store
                        continue
                    pair_sums = completion_sums(token, inputs, mesh)[0]  # [2P], every SP rank alike
                    where = torch.as_tensor([indices[batch.plan.pieces[i].doc] for i in mb], device=device)  # [P]
                    sums[where] = pair_sums.view(-1, 2)  # [P, 2]: (chosen, rejected) of each pair
    finally:
        reference.train(was_training)
    if mesh.dp > 1:
        dist.all_reduce(sums, group=mesh.dp_group)  # [N, 2]: each pair written by one DP group, zeros elsewhere
    sums = sums.cpu()
    return sums[:, 0].contiguous(), sums[:, 1].contiguous()


def with_ref_columns(dataset: Any, chosen: torch.Tensor, rejected: torch.Tensor, model_hash: int) -> Any:
    """`dataset` with TRL's two columns appended (as TRL appends them: `concatenate_datasets(axis=1)`)
    and their fingerprint (`ref_fingerprint.py`): the scored ids, the reference's digest
    `model_hash`, the sums sealed to both."""
    from datasets import Dataset, Features, Value, concatenate_datasets

    sums = {REF_COLUMNS[0]: chosen.numpy().astype(np.float32), REF_COLUMNS[1]: rejected.numpy().astype(np.float32)}
    columns = {**sums, **fingerprint_columns(dataset, *sums.values(), model_hash)}
    features = Features({c: Value("float32") for c in REF_COLUMNS} | {c: Value("int64") for c in FINGERPRINT})
    return concatenate_datasets([dataset, Dataset.from_dict(columns, features=features)], axis=1)
