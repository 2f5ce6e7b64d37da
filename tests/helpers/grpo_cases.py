"""The GRPO trainer tests' shared set-up: saved models, prompts, rewards, fixed generation, one run.

`paths` (a module-scoped pytest fixture; a test module imports it to use it) saves a tiny
Llama policy, a perturbed copy as the reference model (so KL and its gradient are non-zero)
and the word-level tokenizer. `make_prompts` builds the text-prompt dataset,
`reward_length` / `reward_tokens` are the two reward functions, `FixedCompletions` replaces
TRL's generation hook so row k of a step's global generation batch always gets
`fixed_completion(prompt, k)`. `_run` trains one step of TRL's `GRPOTrainer` (mesh_shape
None: the single-process reference) or of `LongGRPOTrainer` on a pool worker's mesh, and
returns the logged metrics and parameter updates (`outcome`; `fpdt`, `memory`: the mesh's FPDT
chunks and the policy's `patch(memory=...)`). WORLD × ROWS rows per step, GENERATIONS
per prompt; LOSS_TOL / GRAD_TOL / METRIC_TOL are the fp32 tolerances these tests share.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.families import save_family
from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import trainer_env
from tests.helpers.word_tokenizer import WORDS, make_tokenizer

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
METRIC_TOL = 1e-5
WORLD, ROWS, GENERATIONS = 4, 3, 2  # rows per process; the reference draws WORLD x ROWS in one process
EOS = 1
SKIP = {"step_time", "tokens_per_s"}  # wall-clock (tokens_per_s: logged by LongGRPOTrainer only)


def fixed_completion(prompt: list[int], k: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * k + sum(prompt))
    n = int(torch.randint(1, 11, (1,), generator=g))
    ids = torch.randint(2, 2 + len(WORDS), (n,), generator=g).tolist()
    return ids[:-1] + [EOS] if k % 4 else ids  # every fourth row is truncated (no EOS)


def reward_length(completion_ids, **kwargs):
    return [float(len(c)) for c in completion_ids]


def reward_tokens(completion_ids, **kwargs):
    return [(sum(c) % 11) / 11.0 for c in completion_ids]


def make_prompts(n: int = 12, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    return Dataset.from_dict({"prompt": [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist())
                                         for k in lengths]})


class FixedCompletions:
    """TRL's generation hook replaced by fixed completions of the step's global row index."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        offset = self.accelerator.process_index * len(prompt_ids)
        return [fixed_completion(list(p), offset + i) for i, p in enumerate(prompt_ids)], None


def _run(model_path: str, ref_path: str, tok_path: str, out_dir: str, loss_type: str, beta: float,
         mesh_shape: tuple[int, int] | None, max_tokens: int | None = None, fpdt: int = 1,
         memory: str | None = None) -> dict:
    from trl import GRPOConfig

    import torch.distributed as dist

    trainer_env()
    processes = dist.get_world_size() if dist.is_initialized() else 1  # the step's WORLD x ROWS rows over them
    cfg = GRPOConfig(output_dir=out_dir, max_steps=1, per_device_train_batch_size=WORLD * ROWS // processes,
                     num_generations=GENERATIONS, max_completion_length=16, temperature=0.7, epsilon=0.2,
                     epsilon_high=0.28, loss_type=loss_type, beta=beta, optim="sgd", learning_rate=1.0,
                     lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True,
                     disable_tqdm=True, save_strategy="no", seed=0, bf16=False, gradient_checkpointing=False)
    return train_one_step(model_path, ref_path, tok_path, cfg, FixedCompletions, "GRPO", mesh_shape, max_tokens,
                          fpdt=fpdt, memory=memory)


def train_one_step(model_path: str, ref_path: str, tok_path: str, cfg, hook: type, name: str,
                   mesh_shape: tuple[int, ...] | None, max_tokens: int | None, fpdt: int = 1,
                   memory: str | None = None) -> dict:
    """One step of TRL's `<name>Trainer` (mesh_shape None) or of `Long<name>Trainer` on a pool
    worker's mesh, with `hook` (the fixed-completion generation hook) first in its bases, on the
    saved policy (its `_name_or_path` pointed at the reference TRL loads for beta > 0), the two
    reward functions and the prompts; `outcome` of it."""
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config._name_or_path = ref_path  # TRL loads the reference from it (beta > 0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    common = dict(reward_funcs=[reward_length, reward_tokens], args=cfg, train_dataset=make_prompts(),
                  processing_class=AutoTokenizer.from_pretrained(tok_path))
    if mesh_shape is not None:
        import hf_longctx

        ulysses, ring, *chunks = mesh_shape  # (ulysses, ring) or (ulysses, ring, FPDT chunks)
        mesh = worker_mesh(ulysses, ring, chunks[0] if chunks else fpdt)
        trainer_cls = type("Trainer", (hook, getattr(hf_longctx, f"Long{name}Trainer")), {})
        trainer = trainer_cls(model=hf_longctx.patch(model, mesh, memory=memory), mesh=mesh, max_tokens=max_tokens,
                              **common)
    else:
        trainer = type("Trainer", (hook, getattr(trl, f"{name}Trainer")), {})(model=model, **common)
    trainer.train()
    return outcome(trainer, before)


def outcome(trainer, before: dict) -> dict:
    """A trained one-step trainer's logged values, parameter updates (`before` minus after, whole
    parameters), micro-batch count and whether its reference is FSDP2-sharded."""
    log = next(h for h in trainer.state.log_history if "grad_norm" in h)
    after = {}
    for k, p in trainer.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 DTensor -> the whole parameter
        after[k] = full.detach().clone()
    ref = getattr(trainer, "ref_model", None)
    return {"log": {k: float(v) for k, v in log.items() if k not in SKIP and v is not None},
            "updates": {k: before[k] - after[k] for k in before},
            "microbatches": getattr(trainer, "last_num_microbatches", 1),
            "ref_sharded": ref is not None and all(hasattr(p, "full_tensor") for p in ref.parameters())}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_trainer")
    make_tokenizer(str(root / "tok"))
    model_path = save_family("llama", root / "policy")
    torch.manual_seed(1)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(str(root / "ref"))
    return model_path, str(root / "ref"), str(root / "tok")


def assert_refused(paths, tmp_path, name: str, kw: dict, match: str) -> None:
    """`Long<name>Trainer` with `<name>Config(**kw)` raises NotSupported at construction, naming the
    value (`match`) and a "Do instead"."""
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_longctx

    model_path, _, tok_path = paths
    cfg = getattr(trl, f"{name}Config")(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                                        report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                                        **{"save_strategy": "no", **kw})
    mesh = hf_longctx.init_sequence_parallel()
    with pytest.raises(hf_longctx.NotSupported, match=match) as err:
        getattr(hf_longctx, f"Long{name}Trainer")(
            model=hf_longctx.patch(AutoModelForCausalLM.from_pretrained(model_path), mesh), mesh=mesh,
            reward_funcs=[reward_length], args=cfg, train_dataset=make_prompts(),
            processing_class=AutoTokenizer.from_pretrained(tok_path))
    assert "Do instead" in str(err.value)
