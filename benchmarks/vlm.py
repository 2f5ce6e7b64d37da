"""Vision work split over the SP group vs the vision tower replicated on every rank, side by side.

Where it sits: outside the library; 4 gloo ranks (tests/helpers/pool.py), U2×R2, a Qwen2.5-VL-style
model built from a config (no hub) whose tower is heavy enough to matter, one packed row of
text-only documents, images of several sizes and a video. Two ways to run the same row:

- split (hf_longctx): `shard_multimodal` deals the images and video slices to the SP ranks
  by encoder cost; each rank encodes its share; ONE all-to-all moves the embedding rows to
  the ranks holding their tokens (and their gradients back);
- replicated: every rank encodes every image and video slice and keeps the rows of its own
  tokens (the same model path, the exchange reduced to each rank's own rows) -- what an SP
  setup that leaves the tower alone does.

Printed per mode: the encoder work per rank (model FLOPs of the units it encoded: max and
mean over ranks, and max/mean), the rows and bytes each rank sends to others, and the
median step time (forward + backward, max over ranks) of REPEATS steps, measured in the same
run. CPU timings on a shared machine are noisy: compare the ratio, not the seconds.

Run:  PYTHONPATH=. python benchmarks/vlm.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

GRID_IMAGES = [(1, 16, 16), (1, 16, 32), (1, 32, 16), (1, 8, 8), (1, 24, 24)]
VIDEO = (4, 16, 16)


def model_and_row():
    import transformers as tf

    from tests.helpers.vlm_cases import END, IMAGE, START, TEXT_HI, VIDEO as VIDEO_ID, VOCAB

    cfg = tf.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}),
        vision_config=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[3]),
        image_token_id=IMAGE, video_token_id=VIDEO_ID, vision_start_token_id=START, vision_end_token_id=END,
    )
    torch.manual_seed(0)
    model = tf.Qwen2_5_VLForConditionalGeneration(cfg).float().train()
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(3, TEXT_HI, (n,), generator=g)  # noqa: E731
    ids, pix, grids = [], [], []
    for k, grid in enumerate(GRID_IMAGES):
        t, h, w = grid
        ids.append(torch.cat([text(20), torch.tensor([START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([END]), text(10)]))
        pix.append(torch.randn(t * h * w, 24, generator=g))
        grids.append(list(grid))
        if k % 2:
            ids.append(text(40))  # a text-only document
    t, h, w = VIDEO
    ids.append(torch.cat([text(8), torch.tensor([START]), torch.full((t * h * w // 4,), VIDEO_ID), torch.tensor([END]), text(8)]))
    row = {
        "input_ids": torch.cat(ids)[None], "position_ids": torch.cat([torch.arange(len(d)) for d in ids])[None],
        "pixel_values": torch.cat(pix), "image_grid_thw": torch.tensor(grids),
        "pixel_values_videos": torch.randn(t * h * w, 24, generator=g), "video_grid_thw": torch.tensor([list(VIDEO)]),
    }
    row["labels"] = row["input_ids"].clone()
    return model, row


def _replicate(shard: dict, batch: dict, spec, mesh) -> dict:
    """The same shard with every unit encoded on this rank and only this rank's rows kept."""
    from hf_longctx.data.multimodal.items import read_row
    from hf_longctx.data.multimodal.routing import exchange_plan, rank_indices
    from hf_longctx.data.multimodal.sharding import SP_VISION_KEY

    info = shard["sp_batch"]
    pos = batch["position_ids"][0]
    cu = [0, *((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist(), pos.numel()]
    vision = read_row(batch, batch["input_ids"][0], cu, spec)
    src = info.source_positions()
    positions = [src[vision.placeholders[u.modality][u.tokens[0]:u.tokens[1]]] for u in vision.units]
    me, p = mesh.sp_rank, mesh.sp
    indices = rank_indices(info.cu_seqlens, mesh.ring, mesh.ulysses, mesh.fpdt_chunks)
    full = exchange_plan(positions, [u.modality for u in vision.units], [me] * len(vision.units), indices, me,
                         info.padded_length)
    # keep the rows of this rank's own tokens: they are the block of the send order destined to `me`
    start = sum(full.send_counts[:me])
    n = full.send_counts[me]
    counts = tuple(n if r == me else 0 for r in range(p))
    plan = dataclasses.replace(full, send_index=full.send_index[start:start + n], send_counts=counts, recv_counts=counts)
    vs = shard[SP_VISION_KEY]
    inputs, rows = [], []
    for mi in range(len(spec.modalities)):
        units = [u for u in vision.units if u.modality == mi]
        if not units:
            inputs.append(None)
            rows.append(0)
            continue
        entry = {"pixels": torch.cat([vision.pixels[mi][u.pixels[0]:u.pixels[1]] for u in units]),
                 "grid": torch.tensor([u.grid for u in units])}
        inputs.append(entry)
        rows.append(sum(u.n_tokens for u in units))
    loads = tuple(sum(spec.cost(u.patches) for u in vision.units) for _ in range(p))
    return {**shard, SP_VISION_KEY: dataclasses.replace(vs, inputs=tuple(inputs), own_rows=tuple(rows), plan=plan,
                                                        loads=loads, units=len(vision.units))}


def run(mode: str, repeats: int) -> dict:
    """One mode on this rank: work, rows sent to others, step times."""
    import torch.distributed as dist

    from hf_longctx.data.multimodal.sharding import SP_VISION_KEY, shard_multimodal
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.integrations.vision.registry import vision_spec
    from tests.helpers.pool import worker_mesh

    torch.set_num_threads(1)
    mesh = worker_mesh(2, 2)
    model, batch = model_and_row()
    spec = vision_spec(model)
    shard = shard_multimodal(batch, mesh, spec)
    if mode == "replicated":
        shard = _replicate(shard, batch, spec, mesh)
    patch(model, mesh)
    vs = shard[SP_VISION_KEY]
    me = mesh.sp_rank
    sent_rows = sum(c for r, c in enumerate(vs.plan.send_counts) if r != me)
    width = spec.hidden * (1 + spec.deepstack)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(**shard).loss
        loss.backward()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    from hf_longctx.distributed.loss import global_loss

    return {"work": vs.loads[me], "sent_rows": sent_rows, "sent_bytes": sent_rows * width * 4 * 2,  # fp32, fwd + bwd
            "step": statistics.median(times[1:]), "tokens": int(shard["input_ids"].shape[1]),
            "loss": float(global_loss(loss, mesh))}


def main() -> None:
    from tests.helpers.pool import GlooPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    pool = GlooPool(4)
    try:
        results = {mode: pool.run(run, mode, args.repeats, timeout=600) for mode in ("split", "replicated")}
    finally:
        pool.close()
    print(f"4 gloo ranks (U2 x R2), {len(GRID_IMAGES)} images {GRID_IMAGES} + a video {VIDEO} + text documents, "
          f"{results['split'][0]['tokens'] * 4} tokens; torch {torch.__version__}, CPU")
    print("| mode | encoder GFLOP per rank max | mean | max/mean | rows sent to other ranks (max) | bytes sent fwd+bwd (max) | step s (median, max over ranks) |")
    print("|---|---|---|---|---|---|---|")
    for mode, rows in results.items():
        work = [r["work"] / 1e9 for r in rows]
        print(f"| {mode} | {max(work):.3f} | {statistics.mean(work):.3f} | {max(work) / statistics.mean(work):.2f} | "
              f"{max(r['sent_rows'] for r in rows)} | {max(r['sent_bytes'] for r in rows) / 1e3:.1f} kB | "
              f"{max(r['step'] for r in rows):.3f} |")
    split = max(r["step"] for r in results["split"])
    rep = max(r["step"] for r in results["replicated"])
    total = sum(r["work"] for r in results["split"])
    print(f"\nsplit / replicated step time: {split / rep:.2f}; busiest rank's encoder work: "
          f"{max(r['work'] for r in results['split']) / total:.2f} of the micro-batch (replicated: 1.00); "
          f"the two modes' losses differ by {abs(results['split'][0]['loss'] - results['replicated'][0]['loss']):.1e}")


if __name__ == "__main__":
    main()
