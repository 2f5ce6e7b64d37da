"""One training step against the ALST recipe at parity of checkpointing, 4 gloo ranks, before and after.

Where it sits: a timing of the whole patched step (`patch(model, mesh, memory=...)`: Ulysses 4,
row-chunked layers of memory="max", keep-attention of memory="high", chunked MLP and loss)
beside the ALST recipe (Arctic Long Sequence Training, DeepSpeed's `ulysses_sp`): Ulysses
attention, every decoder layer under HF's non-reentrant activation checkpointing, the MLP
tiled along the sequence into ceil(S_local / hidden) shards whose backward recomputes each
shard and accumulates the parameters' gradients into `.grad` through autograd (`_TiledMLP`),
and the LM head + loss tiled the same way (`_TiledLoss`, one shard per 1,024 tokens).
DeepSpeed is not installed here, so the recipe is rebuilt from its description on torch/HF
pieces; its Ulysses attention is ours (one all-to-all of q, k, v, the CPU flash kernel), so the
pair differs only in how the layer, the MLP and the loss are chunked and checkpointed.

Modes: "alst"; "max" (memory="max"); "max+keep" (memory="max", keep_attention=True: the
attention's output and LSE kept, not recomputed; skipped by a code without the option);
"high" (memory="high": checkpoint="attention", the attention's saved tensors kept).

Rows: the tiny Llama of benchmarks/recompute.py (hidden 256, 8/4 heads, 2 layers, vocab 8K),
one packed row of 16K or 32K tokens (documents of 14K, 8K, 5K, 3K, 2K tokens, cut or padded),
one step = forward + backward + AdamW step, modes interleaved, `--repeats` rounds; each rank
one thread. With `--before DIR` the same run is made with the package at DIR (e.g. /work/main)
in a second process, so both codes are measured by one command; the table prints medians and
the ratio ours / ALST per code.

    PYTHONPATH=. python benchmarks/alst_pair.py --tokens 16384 32768 --repeats 3 --before /work/main
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODES = {"alst": None, "max": {"memory": "max"}, "max+keep": {"memory": "max", "keep_attention": True},
         "high": {"memory": "high"}}
DOCS = [14336, 8192, 5120, 3072, 2048]


class _TiledMLP(torch.autograd.Function):
    """ALST's tiled MLP: forward shard by shard without a graph; backward recomputes each shard
    and runs autograd on it, so its parameters' gradients land in `.grad` shard by shard."""

    @staticmethod
    def forward(ctx, fn, shards, x, *params):
        ctx.fn, ctx.shards, ctx.params = fn, shards, len(params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(s) for s in torch.chunk(x, shards, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        lo = 0
        for s in torch.chunk(x, ctx.shards, dim=1):
            hi = lo + s.shape[1]
            xs = s.detach().requires_grad_()
            with torch.enable_grad():
                torch.autograd.backward(ctx.fn(xs), dout[:, lo:hi])
            dx[:, lo:hi] = xs.grad
            lo = hi
        return (None, None, dx) + (None,) * ctx.params


class _TiledLoss(torch.autograd.Function):
    """ALST's tiled logits + loss: the loss shard by shard without logits kept; backward
    recomputes each shard's logits and runs autograd on its loss (LM-head gradient into `.grad`)."""

    @staticmethod
    def forward(ctx, head, x, labels, denominator, shards):
        ctx.head, ctx.labels, ctx.denominator, ctx.shards = head, labels, denominator, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return sum(F.cross_entropy(head(s).float(), t, ignore_index=-100, reduction="sum")
                       for s, t in zip(torch.chunk(x, shards), torch.chunk(labels, shards))) / denominator

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        lo = 0
        for s, t in zip(torch.chunk(x, ctx.shards), torch.chunk(ctx.labels, ctx.shards)):
            hi = lo + s.shape[0]
            xs = s.detach().requires_grad_()
            with torch.enable_grad():
                loss = F.cross_entropy(ctx.head(xs).float(), t, ignore_index=-100, reduction="sum") / ctx.denominator
                torch.autograd.backward(loss * grad)
            dx[lo:hi] = xs.grad
            lo = hi
        return None, dx, None, None, None


def _alst(model, tokens: int):
    """The ALST recipe on a model patched with plain Ulysses attention (module docstring)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hidden = model.config.hidden_size
    for layer in model.model.layers:
        mlp, fn = layer.mlp, layer.mlp.forward
        params = [p for p in mlp.parameters()]
        mlp.forward = lambda x, _fn=fn, _p=params: _TiledMLP.apply(_fn, max(1, math.ceil(x.shape[1] / hidden)), x, *_p)

    def step(shard):
        kw = {k: v for k, v in shard.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
        h = model.model(**kw).last_hidden_state  # [1, S_local, Hd]
        x, labels = h.reshape(-1, h.shape[-1]), shard["shift_labels"].reshape(-1)
        return _TiledLoss.apply(model.lm_head, x, labels, float(shard["num_items_in_batch"]),
                                max(1, math.ceil(x.shape[0] / 1024)))

    return step


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                              num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                                              max_position_embeddings=32769))


def _batch(tokens: int) -> dict:
    docs, left = [], tokens
    for n in DOCS:
        if left > 0:
            docs.append(min(n, left))
            left -= docs[-1]
    if left:
        docs.append(left)
    ids = torch.randint(0, 8192, (1, tokens), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in docs])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _timed(step, model, shard, optim) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step(shard).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, init_file: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4,
                            timeout=timedelta(minutes=90))
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.distributed.mesh import init_sequence_parallel
    from hf_longctx.integrations.model_patch import patch

    mesh = init_sequence_parallel(4, 1)
    out = {}
    for tokens in args.tokens:
        shard = shard_batch(_batch(tokens), mesh)
        runs = {}
        for mode, options in MODES.items():
            try:
                model = patch(copy.deepcopy(_llama()), mesh, **(options or {}))
            except TypeError:  # an option the measured code does not have (keep_attention before it existed)
                continue
            model.train()
            step = _alst(model, tokens) if mode == "alst" else (lambda s, _m=model: _m(**s).loss)
            runs[mode] = (step, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
            _timed(step, model, shard, runs[mode][2])  # warm-up
        times = {m: [] for m in runs}
        for _ in range(args.repeats):
            for mode in runs:  # interleaved: machine noise hits every mode alike
                times[mode].append(_timed(*runs[mode][:2], shard, runs[mode][2]))
        out[tokens] = times
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def _measure(code: str, args) -> dict:
    """Run the 4 ranks with the package at `code` first on the path (a child process)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tokens", *map(str, args.tokens),
           "--repeats", str(args.repeats)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([code, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", help="a checkout whose package is measured the same way (e.g. /work/main)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from benchmarks._ranks import run_ranks

        print(json.dumps(run_ranks(_worker, 4, args, timeout=5400)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    codes = ([("before", args.before)] if args.before else []) + [("after", here)]
    res = {name: _measure(code, args) for name, code in codes}
    print("| code | tokens | mode | step s (median) | / ALST | runs |")
    print("|---|---|---|---|---|---|")
    for name, _ in codes:
        for tokens, times in res[name].items():
            alst = statistics.median(times["alst"])
            for mode, runs in times.items():
                med = statistics.median(runs)
                print(f"| {name} | {tokens} | {mode} | {med:.2f} | {med / alst:.3f} | {' '.join(f'{x:.2f}' for x in runs)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
