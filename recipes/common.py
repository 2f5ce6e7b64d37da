"""The options every training recipe shares, and where each one goes.

Where it sits: before the training data flow. `recipes/pretrain.py` (and `lora.py` on top
of it), `recipes/sft.py` and `recipes/demo.py` add these to their own parsers, so one
setting printed by `hf-longctx plan` ("as recipe flags") pastes into any of them:

  --ulysses / --ring / --fpdt-chunks  -> init_sequence_parallel(...)          (USP §4, FPDT §3)
  --memory off|balanced|high|max      -> patch(model, mesh, memory=...)       (FPDT §4 presets)
  --kv-offload                         -> patch(kv_offload=True)  (expert knob; not with --memory)
  --inputs-on-device N                 -> patch(inputs_on_device=N)  (with --memory high/max)
  --keep-attention                     -> patch(keep_attention=True)  (with --memory max)
  --loss-chunk-rows N                  -> patch(loss_chunk_rows=N)  (with --memory balanced/high/max)
  --fused                              -> patch(fused=True)  (compiled norms, RoPE, SwiGLU, loss tail)
  --mixers auto|heads|state            -> patch(mixers=...)  (hybrid models' linear recurrences)
  --sync-each-microbatch               -> LongContextTrainer(sync_each_microbatch=True)
  --param-offload                      -> LongContextTrainer(param_offload=True) (FSDP2 CPUOffloadPolicy)
  --mixed-precision bf16|fp32          -> TrainingArguments(bf16=...) -> fsdp_plan(mixed_precision=...)
                                          (default bf16 where CUDA is available, fp32 on CPU)
  --resume                             -> trainer.train(resume_from_checkpoint=True)
  --tokenizer                          -> AutoTokenizer.from_pretrained (default: --model)

A recipe that does not honour one of them refuses it when set (`refuse_flags`): the rollout
recipes refuse --sync-each-microbatch and --param-offload (`rollout_refusals`). Also shared by
the post-training recipes (`dpo.py`, `grpo.py`, `rloo.py`): `build_tiny_model` (their CPU demo model, built
from a config and saved with `save_pretrained`, so it loads like a real checkpoint),
`step_lines` (one printed line per optimizer step with TRL's metric names, and every rank's
logs in `OUTPUT_DIR/steps.rank<R>.jsonl`), `parse_post_training_args`, `recipe_mesh`,
`print_patch` and `train_and_export`; and by the rollout recipes (`grpo.py`, `rloo.py`): `parse_rollout_args`,
`rollout_refusals`, `rollout_config_kwargs`, the made-up prompts (`make_prompts`), the reward
(`format_scores`) and `train_rollouts` (model, data, trainer, training).

What a recipe builds for all its ranks (the tiny Llama here) is built once per job by global rank
0 in OUTPUT_DIR, which every node must then see; downloads fill the caches in turn, rank 0 first,
then one rank per node (the rule and its reasons: `shared_files.py`).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from shared_files import build_once, fill_caches_in_turn

from hf_longctx.config import MEMORY_PRESETS


def add_common_args(p: argparse.ArgumentParser, *, ulysses: int = 1, ring: int = 1,
                    mixed_precision: str | None = None) -> argparse.ArgumentParser:
    """Add the shared options to `p` (defaults per recipe: the demo runs Ulysses 2 × ring 2 in fp32;
    `mixed_precision=None`: bf16 where CUDA is available, fp32 on CPU, where bf16 matmuls are slow)."""
    g = p.add_argument_group("parallelism and memory (shared by every recipe; `hf-longctx plan` prints them)")
    g.add_argument("--tokenizer", default=None, help="from_pretrained path or hub id; default: --model")
    g.add_argument("--ulysses", type=int, default=ulysses, help="Ulysses degree of each SP group")
    g.add_argument("--ring", type=int, default=ring, help="ring degree of each SP group")
    g.add_argument("--fpdt-chunks", type=int, default=1, help="FPDT chunks per local sequence (needs --ring 1)")
    g.add_argument("--memory", choices=MEMORY_PRESETS, default=None,
                   help="patch(memory=...) preset: chunked MLP/loss ('balanced'), plus checkpointing that keeps the "
                        "attention ('high') or full offloaded checkpointing ('max'), both with K/V offload under FPDT; "
                        "default: none")
    g.add_argument("--kv-offload", action="store_true", help="FPDT: offload K/V chunks to host (not with --memory)")
    g.add_argument("--inputs-on-device", type=int, default=0,
                   help="patch(inputs_on_device=N): the last N decoder layers keep their checkpointed inputs on the GPU "
                        "(with --memory high/max; `hf-longctx plan` suggests N where host memory binds)")
    g.add_argument("--keep-attention", action="store_true",
                   help="patch(keep_attention=True): with --memory max, keep each layer's attention output and LSE on "
                        "the host so the backward does not run the attention again (`hf-longctx plan` says when)")
    g.add_argument("--loss-chunk-rows", type=int, default=None,
                   help="patch(loss_chunk_rows=N): rows per LM-head chunk (with --memory balanced/high/max; "
                        "`hf-longctx plan` suggests N where GPU memory binds); default: at least 2048")
    g.add_argument("--fused", action="store_true",
                   help="patch(fused=True): norms, RoPE, SwiGLU and the loss tail as compiled, fused kernels")
    g.add_argument("--mixers", choices=("auto", "heads", "state"), default=None,
                   help="patch(mixers=...): how a hybrid model's linear recurrences cross the SP group (head all-to-all "
                        "or state passing); default: per micro-batch by the cost rule")
    g.add_argument("--sync-each-microbatch", action="store_true",
                   help="reduce-scatter gradients in every micro-batch (sharded accumulation, 4 B/param less memory)")
    g.add_argument("--param-offload", action="store_true",
                   help="FSDP2 CPUOffloadPolicy: parameter/gradient shards and optimizer states in host memory")
    g.add_argument("--mixed-precision", choices=("bf16", "fp32"), default=mixed_precision,
                   help="bf16 compute with fp32 master weights, or fp32 throughout; default: "
                        + (mixed_precision or "bf16 where CUDA is available, else fp32"))
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint-N in the output dir")
    return p


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse combinations the library would refuse later on every rank (before any process group);
    resolve the device-dependent default of --mixed-precision."""
    if args.mixed_precision is None:
        import torch

        args.mixed_precision = "bf16" if torch.cuda.is_available() else "fp32"
    for name in ("ulysses", "ring", "fpdt_chunks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.inputs_on_device < 0:
        p.error(f"--inputs-on-device must be >= 0, got {args.inputs_on_device}")
    if args.inputs_on_device and args.memory not in ("high", "max"):
        p.error(f"--inputs-on-device {args.inputs_on_device} keeps checkpointed layer inputs on the GPU: it needs "
                f"--memory high or max (got --memory {args.memory})")
    if getattr(args, "keep_attention", False) and args.memory != "max":
        p.error(f"--keep-attention keeps the attention of memory='max''s row-chunked layers: it needs --memory max "
                f"(got --memory {args.memory}; 'high' keeps the attention's saved tensors already)")
    rows = getattr(args, "loss_chunk_rows", None)
    if rows is not None and (rows < 1 or args.memory not in ("balanced", "high", "max")):
        p.error(f"--loss-chunk-rows {rows} sets the rows of the chunked LM head: it needs a value >= 1 and --memory "
                f"balanced, high or max (got --memory {args.memory})")
    if args.memory is not None and args.kv_offload:
        p.error(f"--memory {args.memory} and --kv-offload together: the preset sets K/V offload ('max' with "
                "--fpdt-chunks > 1 offloads); pass one of them")
    return args


def patch_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of `patch(model, mesh, ...)`."""
    kwargs = {"memory": args.memory} if args.memory is not None else ({"kv_offload": True} if args.kv_offload else {})
    if getattr(args, "inputs_on_device", 0):
        kwargs["inputs_on_device"] = args.inputs_on_device
    if getattr(args, "keep_attention", False):
        kwargs["keep_attention"] = True
    if getattr(args, "loss_chunk_rows", None) is not None:
        kwargs["loss_chunk_rows"] = args.loss_chunk_rows
    if getattr(args, "fused", False):
        kwargs["fused"] = True
    return {**kwargs, "mixers": args.mixers} if getattr(args, "mixers", None) is not None else kwargs


def checkpointing(on: bool) -> dict:
    """HF's activation-checkpointing flag for a `TrainingArguments` / TRL config, under its current
    name (`activation_checkpointing`; `gradient_checkpointing` on transformers < 5.18, where it
    is not yet deprecated): the trainer maps it to `patch(checkpoint=True)`. TRL's configs
    default the old name to True and warn unless the new one is given."""
    from transformers import TrainingArguments

    from hf_longctx._compat import checkpointing_fields

    return {checkpointing_fields(TrainingArguments)[0]: on}


def trainer_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of `LongContextTrainer` / `LongContextTrainerMixin` these options set."""
    return {"sync_each_microbatch": args.sync_each_microbatch, "param_offload": args.param_offload}


def refuse_flags(p: argparse.ArgumentParser, args: argparse.Namespace, unsupported: dict[str, str]) -> None:
    """A recipe that does not honour some shared flags refuses them when set (never drops one
    silently): `unsupported` maps the option name to what to do instead."""
    for name, instead in unsupported.items():
        if getattr(args, name) != p.get_default(name):
            p.error(f"--{name.replace('_', '-')} is not supported by this recipe; do instead: {instead}")


def build_tiny_model(path: str, seed: int) -> None:
    """A tiny Llama and its word-level tokenizer ("<pad>" 0, "<eos>" 1, words "w0".."w125"), saved to
    `path` with `save_pretrained` (call on one rank; the others `from_pretrained` it afterwards)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(126)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)


def add_model_data_args(p: argparse.ArgumentParser, *, data: str) -> None:
    """--model, --dataset, --data-files, --split of the post-training recipes (both optional: without
    them `load_model_and_data` builds a tiny Llama and makes the data); `data` says what the
    dataset holds."""
    p.add_argument("--model", default=None, help="from_pretrained path or hub id; default: a tiny Llama built here")
    p.add_argument("--dataset", default=None, help=f"datasets builder or hub id of {data}; default: made here")
    p.add_argument("--data-files", nargs="*", default=None)
    p.add_argument("--split", default="train")


def parse_post_training_args(p: argparse.ArgumentParser, argv: Any, *, output_dir: str,
                             refused: dict[str, str]) -> argparse.Namespace:
    """The arguments of a post-training recipe (`dpo.py`, `grpo.py`): its own options in `p`, plus
    --output-dir, --save-every, --export, --timeout, --seed and the shared options (fp32 by
    default: bf16 matmuls are slow on CPU), checked; `refused`: {flag: what to do instead}."""
    p.add_argument("--output-dir", default=output_dir)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint-N every this many steps (0: none)")
    p.add_argument("--export", action="store_true", help="at the end, save_pretrained the full model to output-dir/final")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a collective may block before all ranks stop")
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, mixed_precision="fp32")
    args = check_common_args(p, p.parse_args(argv))
    refuse_flags(p, args, refused)
    if args.resume and not args.save_every:
        p.error("--resume needs checkpoints: pass the --save-every of the run it continues")
    return args


def load_model_and_data(args: argparse.Namespace, make_default: Any) -> tuple[Any, Any, Any]:
    """(model, tokenizer, dataset) of a post-training recipe: --model (default: the tiny Llama of
    `build_tiny_model`, built once per job by global rank 0 in OUTPUT_DIR/tiny-llama, which every
    node must see: `shared_files.build_once`) loaded with `from_pretrained` in fp32 (master
    weights), its tokenizer (or --tokenizer), and --dataset through `load_dataset` (default:
    `make_default(args)`, made here); downloads fill the caches in turn (`fill_caches_in_turn`)."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = args.model or os.path.join(args.output_dir, "tiny-llama")
    if args.model is None:
        build_once(model_path, lambda: build_tiny_model(model_path, args.seed), what="the tiny Llama",
                   fix="pass an --output-dir on a file system every node mounts, or a prebuilt --model (with its "
                       "tokenizer) that every node can read")
    with fill_caches_in_turn():
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if args.dataset is None:
            data = make_default(args)
        else:
            data = load_dataset(args.dataset, data_files=args.data_files, split=args.split)
    return model, tokenizer, data


def recipe_mesh(args: argparse.Namespace, config: Any, device: Any) -> Any:
    """The SPMesh of --ulysses / --ring / --fpdt-chunks; rank 0 prints what it runs on."""
    from hf_longctx import init_sequence_parallel
    from hf_longctx.training.launch import describe

    mesh = init_sequence_parallel(ulysses_degree=args.ulysses, ring_degree=args.ring, fpdt_chunks=args.fpdt_chunks)
    if config.process_index == 0:
        print(describe(mesh, device, param_offload=args.param_offload))
    return mesh


def print_patch(model: Any, is_main: bool) -> None:
    """Rank 0 prints the memory options `model`'s patch holds (read back from the model after the
    trainer mapped its config's checkpointing flag onto it: what the run trains with)."""
    from hf_longctx.integrations.model_patch import patch_state

    if is_main:
        o = patch_state(model).options
        print(f"patched: memory={o.memory!r}, checkpoint={o.checkpoint!r}, kv_offload={o.kv_offload}, "
              f"mlp_chunks={o.mlp_chunks!r}, loss_chunks={o.loss_chunks!r}, inputs_on_device={o.inputs_on_device}",
              flush=True)


def train_and_export(trainer: Any, args: argparse.Namespace) -> None:
    """`trainer.train()` (from the newest checkpoint-N with --resume); with --export, the consolidated
    model in OUTPUT_DIR/final (loads with `from_pretrained`). The printer callback goes: `step_lines`
    prints each step once."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.export:
        trainer.save_model(os.path.join(args.output_dir, "final"))  # a collective: every rank calls it


def step_lines(output_dir: str, rank: int, is_main: bool) -> Any:
    """A TrainerCallback: for every logged optimizer step, rank 0 prints `step N: name=value, ...`
    (TRL's metric names as logged) and every rank appends the logs to
    `output_dir/steps.rank<rank>.jsonl`, emptied when training starts (the ranks' global values agree)."""
    from transformers import TrainerCallback

    path = os.path.join(output_dir, f"steps.rank{rank}.jsonl")

    class StepLines(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            os.makedirs(output_dir, exist_ok=True)
            open(path, "w").close()  # this run's lines only

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if not logs or "loss" not in logs:  # the end-of-training summary has train_loss, not loss
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if is_main:
                print(f"step {row['step']}: " + ", ".join(f"{k}={v:.6g}" for k, v in row.items() if k != "step"),
                      flush=True)

    return StepLines()


def add_rollout_args(p: argparse.ArgumentParser, *, beta: float) -> None:
    """The options of the rollout recipes (`grpo.py`, `rloo.py`): model and prompts, the step's rows,
    generation (sequence-parallel or per rank), `max_tokens` micro-batches, the KL coefficient (default `beta`), temperature, lr."""
    add_model_data_args(p, data="prompts (a `prompt` column)")
    p.add_argument("--prompts", type=int, default=64, help="prompts of the locally made dataset (without --dataset)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--per-device-train-batch-size", type=int, default=4,
                   help="rows (prompt x generation) each process draws per step; times the processes: a multiple "
                        "of --num-generations")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens of one packed micro-batch of an SP group: the step's rows split into micro-batches "
                        "with gradient accumulation (the trainer's max_tokens=); default: one micro-batch per step")
    p.add_argument("--beta", type=float, default=beta, help="KL coefficient to TRL's reference (the initial model)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--generation", choices=("sp", "per-rank"), default="sp",
                   help="sp: the SP group decodes its rows together, the KV cache sharded over it (sp_generate); "
                        "per-rank: each rank runs TRL's generate on gathered, unpatched weights")


def parse_rollout_args(doc: str, argv: Any, *, beta: float, output_dir: str, trainer: str,
                       own: dict[str, dict]) -> argparse.Namespace:
    """The arguments of a rollout recipe (`doc`: its module docstring, whose first line describes it):
    `add_rollout_args`, the recipe's `own` options ({flag: add_argument keywords}),
    `parse_post_training_args` refusing `rollout_refusals(trainer)`."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    add_rollout_args(p, beta=beta)
    for flag, kwargs in own.items():
        p.add_argument(flag, **kwargs)
    return parse_post_training_args(p, argv, output_dir=output_dir, refused=rollout_refusals(trainer))


def rollout_refusals(trainer: str) -> dict[str, str]:
    """The shared flags a rollout recipe refuses (`refuse_flags`), with what to do instead: the
    trainer options `LongGRPOTrainer` / `LongRLOOTrainer` do not take (the memory flags go to
    `patch` and are honoured)."""
    return {
        "sync_each_microbatch": f"leave it off ({trainer} always reduce-scatters the gradients in every micro-batch's "
                                "backward, so there is nothing for the flag to change)",
        "param_offload": f"leave it off ({trainer} takes no param_offload: its FSDP2 shards and optimizer states stay "
                         "on the device; for less device memory use --memory high or max)",
    }


def rollout_config_kwargs(args: argparse.Namespace, device: Any) -> dict:
    """The `GRPOConfig` / `RLOOConfig` keyword arguments the rollout options set."""
    return dict(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr, max_grad_norm=1.0, logging_steps=1,
        save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 500, seed=args.seed,
        bf16=args.mixed_precision == "bf16", use_cpu=device.type == "cpu",
        report_to=[], disable_tqdm=True, **checkpointing(False),
        per_device_train_batch_size=args.per_device_train_batch_size, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, beta=args.beta, temperature=args.temperature,
    )


def format_scores(completion_ids: list[list[int]], eos_token_id: int) -> list[float]:
    """The rollout recipes' reward: +1 for a completion that ends with EOS (it finished), plus the
    share of its tokens with an even id (a stand-in for a format rule); one value per completion."""
    return [float(bool(c) and c[-1] == eos_token_id) + sum(t % 2 == 0 for t in c) / max(len(c), 1)
            for c in completion_ids]


def make_prompts(n: int, seed: int, vocab_words: int = 126):
    """`n` text prompts of 3..11 words of the tiny tokenizer ("w0".."w125")."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    words = lambda k: " ".join(f"w{i}" for i in torch.randint(0, vocab_words, (k,), generator=g).tolist())  # noqa: E731
    return Dataset.from_dict({"prompt": [words(k) for k in lengths]})


def train_rollouts(args: argparse.Namespace, config_name: str, trainer_cls: Any, **config_kwargs: Any) -> None:
    """A rollout recipe's run: the process group, TRL's `config_name` ("GRPOConfig" / "RLOOConfig")
    from the options (`rollout_config_kwargs`) and `config_kwargs`, the mesh, --model and --dataset
    (or the tiny Llama and `make_prompts`), `trainer_cls` (LongGRPOTrainer / LongRLOOTrainer) on the
    patched model with the `format_reward` below, `step_lines`, then `train_and_export`."""
    import trl

    from hf_longctx import patch
    from hf_longctx.training.launch import init_distributed

    device = init_distributed(timeout_s=args.timeout)  # LOCAL_RANK's device + the process group
    config = getattr(trl, config_name)(**rollout_config_kwargs(args, device), **config_kwargs)

    mesh = recipe_mesh(args, config, device)
    model, tokenizer, prompts = load_model_and_data(args, lambda a: make_prompts(a.prompts, a.seed))

    def format_reward(completion_ids, **kwargs):  # TRL: the sampled ids of this process's completions; logs
        return format_scores(completion_ids, tokenizer.eos_token_id)  # rewards/format_reward/mean|std

    trainer = trainer_cls(
        model=patch(model, mesh, **patch_kwargs(args)), mesh=mesh, reward_funcs=[format_reward], args=config,
        train_dataset=prompts, processing_class=tokenizer, max_tokens=args.max_tokens, generation=args.generation,
        callbacks=[step_lines(args.output_dir, config.process_index, config.process_index == 0)],
    )
    print_patch(trainer.model, config.process_index == 0)
    train_and_export(trainer, args)
