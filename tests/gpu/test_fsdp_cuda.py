"""FSDP2 with bf16 mixed precision on one GPU (NCCL, world of 1): the patched model takes a
training step whose loss matches the unsharded bf16-autocast model to bf16 precision and
whose gradients are finite."""

import socket

import pytest
import torch
import torch.distributed as dist

from hf_longctx import init_sequence_parallel, patch
from hf_longctx.integrations.accelerate import fsdp_plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg)


@pytest.fixture
def nccl_world():
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield
    dist.destroy_process_group()


def test_fsdp2_bf16_one_gpu(nccl_world):
    ids = torch.randint(0, 1024, (1, 1024), device="cuda")
    ref = _model().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss = ref(input_ids=ids, labels=ids).loss.float()
    mesh = init_sequence_parallel()
    model = patch(_model(), mesh)
    fsdp_plan(model, mesh, mixed_precision="bf16").apply(model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item())
    assert all(torch.isfinite(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).all()
               for p in model.parameters() if p.grad is not None)
