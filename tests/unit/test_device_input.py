"""The input path's host -> device copies never block the host on CPU.

Counted with the counters of benchmarks/_counting.py (what benchmarks/hot_path.py uses): a
`.to(device)` of a host-built tensor is a host -> device copy, and a sync unless it is
`non_blocking=True`. The step dataloader's shard (collator ->
`shard_batch`, built on the host) goes through `LongContextTrainer._micro_inputs`; the
counts are the same on a GPU machine, where `to_device` also pins (not testable on CPU).
"""

from __future__ import annotations

import types

import torch

from benchmarks._counting import Counter
from hf_longctx.devices import to_device, upload_stacked
from hf_longctx.data.sharding import SP_METADATA_KEY, shard_batch
from hf_longctx.distributed.mesh import init_sequence_parallel
from hf_longctx.training.sft.trainer import LongContextTrainer


def _batch() -> dict:
    docs = [7, 5, 12]
    ids = (torch.arange(sum(docs)) * 7 % 87 + 3)[None]  # [1, S]; factories the counter sees as host
    pos = torch.cat([torch.arange(n) for n in docs])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos, "loss_weight": torch.ones(1, sum(docs))}


def test_trainer_input_path_copies_without_blocking():
    counter = Counter()
    mesh = init_sequence_parallel()
    with counter.counting():
        shard = shard_batch(_batch(), mesh, device="cpu")  # the collator's work, on the host
    # shard_batch: one copy per dtype (int64: input_ids, position_ids, labels; float: loss_weight), none blocking
    assert counter.counts["h2d"] == 2 and counter.counts["syncs"] == 0, (counter.counts, counter.sync_sites)
    tensors = {id(v): v for v in shard.values() if isinstance(v, torch.Tensor)}
    assert len(tensors) == 4  # labels IS shift_labels
    counter = Counter()  # the step dataloader hands host tensors to the Trainer: unmarked, they are host
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(device=torch.device("cpu"), dataloader_pin_memory=True))
    with counter.counting():
        moved = LongContextTrainer._micro_inputs(trainer, {"micro_batches": [shard], "tokens": 24})
    # one non-blocking copy per tensor of the shard (transformers' own _prepare_input: a blocking
    # .to() per key, 5 syncs here)
    assert counter.counts["h2d"] == 4 and counter.counts["syncs"] == 0, (counter.counts, counter.sync_sites)
    mb = moved["micro_batches"][0]
    assert mb[SP_METADATA_KEY] is shard[SP_METADATA_KEY] and mb["num_items_in_batch"] == shard["num_items_in_batch"]
    assert mb["labels"] is mb["shift_labels"]
    for k, v in shard.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(mb[k], v)


def test_to_device_counts_one_non_blocking_copy_per_host_tensor():
    counter = Counter()
    with counter.counting():
        batch = {"a": torch.arange(6), "b": [torch.zeros(2), torch.ones(3)], "meta": "x"}
        out = to_device(batch, "cpu")
        assert counter.counts == {"kernels": 0, "collectives": 0, "h2d": 3, "d2h": 0, "syncs": 0}, counter.sync_sites
        torch.arange(6).to(torch.device("cpu"))  # transformers' Trainer._prepare_input (args.device): a sync
        assert counter.counts["syncs"] == 1
    assert out["meta"] == "x" and torch.equal(out["b"][1], torch.ones(3))


def test_upload_stacked_one_copy_per_dtype_same_values():
    counter = Counter()
    with counter.counting():
        t = {"x": torch.arange(8).view(2, 4), "y": torch.arange(8, 16).view(2, 4), "w": torch.full((2, 4), 0.5)}
        out = upload_stacked(t, "cpu")
    assert counter.counts["h2d"] == 2 and counter.counts["syncs"] == 0
    assert list(out) == ["x", "y", "w"]
    for k in t:
        assert torch.equal(out[k], t[k]) and out[k].dtype == t[k].dtype and out[k].is_contiguous()
