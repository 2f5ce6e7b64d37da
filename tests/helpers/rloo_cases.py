"""The RLOO trainer tests' set-up, on top of the GRPO trainer tests' (tests/helpers/grpo_cases.py:
the saved policy / perturbed reference / tokenizer, prompts, rewards, fixed completions).

`FixedRLOOCompletions` replaces TRL's RLOO generation hook (its signature has no
`num_generations` and returns the completion ids only) so row k of a step's global generation
batch always gets `fixed_completion(prompt, k)`. `run_rloo` trains one step of TRL's
`RLOOTrainer` (mesh_shape None: the single-process reference) or of `LongRLOOTrainer` on a pool
worker's mesh (ulysses, ring, fpdt_chunks; the policy `patch`ed with `memory`) and returns
`grpo_cases.outcome` (through `grpo_cases.train_one_step`). CASES: the RLOOConfig settings under
test. GENERATIONS = 4: a prompt's completions straddle processes, and
each leave-one-out baseline averages three siblings.
"""

from __future__ import annotations

from tests.helpers.grpo_cases import ROWS, WORLD, fixed_completion, train_one_step
from tests.helpers.trainer_cases import trainer_env

GENERATIONS = 4
# name -> RLOOConfig settings: no KL with advantages normalised over the batch; the KL penalty in the
# reward (a reference different from the policy) with the summed rewards clipped
CASES = {"normalized": dict(beta=0.0, normalize_advantages=True),
         "kl": dict(beta=0.05, reward_clip_range=(0.0, 6.0))}


class FixedRLOOCompletions:
    """TRL's RLOO generation hook replaced by fixed completions of the step's global row index."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        offset = self.accelerator.process_index * len(prompt_ids)
        return [fixed_completion(list(p), offset + i) for i, p in enumerate(prompt_ids)]


def run_rloo(model_path: str, ref_path: str, tok_path: str, out_dir: str, case: str,
             mesh_shape: tuple[int, int, int] | None, max_tokens: int | None = None, memory: str | None = None) -> dict:
    from trl import RLOOConfig

    import torch.distributed as dist

    trainer_env()
    processes = dist.get_world_size() if dist.is_initialized() else 1  # the step's WORLD x ROWS rows over them
    cfg = RLOOConfig(output_dir=out_dir, max_steps=1, per_device_train_batch_size=WORLD * ROWS // processes,
                     num_generations=GENERATIONS, max_completion_length=16, temperature=0.7, epsilon=0.2,
                     epsilon_high=0.28, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=1.0,
                     logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0,
                     bf16=False, gradient_checkpointing=False, **CASES[case])
    return train_one_step(model_path, ref_path, tok_path, cfg, FixedRLOOCompletions, "RLOO", mesh_shape, max_tokens,
                          memory=memory)
