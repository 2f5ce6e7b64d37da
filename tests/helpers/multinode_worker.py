"""One rank of the two-node launch of tests/integration/test_multinode.py (run by `torchrun`).

`torchrun --nnodes 2 --nproc-per-node 2 ... tests/helpers/multinode_worker.py MODEL OUT`: every
rank initialises gloo from torchrun's environment (`hf_longctx.training.launch.init_distributed`),
builds the mesh that `ParallelismConfig(sp_size=4)` maps to with LOCAL_WORLD_SIZE=2 ranks per node
(Ulysses 2 inside each node, the ring of 2 across the nodes), patches the model loaded with
`from_pretrained`, shards it with FSDP2 over all 4 ranks and trains two SGD steps on packed
batches (`tests/helpers/families.packed_batch`, seeds 0 and 1). Rank 0 writes to OUT: the global
loss of each step, the first step's gradients and each parameter's change over both steps (full
tensors), and every rank's (node, ring rank, Ulysses rank)."""

from __future__ import annotations

import os
import sys

import torch

LR = 0.1  # plain SGD: an update is -LR x the gradient, so comparing updates compares gradients


def main() -> None:
    import torch.distributed as dist
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM

    import hf_longctx
    from hf_longctx.training.launch import init_distributed
    from tests.helpers.families import packed_batch

    model_path, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    init_distributed(timeout_s=120)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    mesh = hf_longctx.mesh_from_parallelism_config(ParallelismConfig(sp_size=4), model.config)
    hf_longctx.patch(model, mesh)
    hf_longctx.fsdp_plan(model, mesh).apply(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    before = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    losses, grads = [], {}
    for seed in (0, 1):
        loss = model(**hf_longctx.shard_batch(packed_batch(seed=seed), mesh)).loss  # this rank's share
        loss.backward()  # FSDP2 sums the shares over the 4 ranks
        if not grads:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(hf_longctx.global_loss(loss, mesh).item())
    updates = {n: p.full_tensor().detach() - before[n] for n, p in model.named_parameters()}
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, (int(os.environ["GROUP_RANK"]), mesh.ring_rank, mesh.ulysses_rank))
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "grads": grads, "updates": updates, "places": places,
                    "degrees": (mesh.ulysses, mesh.ring, mesh.dp)}, out)


if __name__ == "__main__":
    from hf_longctx import run_rank

    run_rank(main)
