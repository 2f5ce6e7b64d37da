"""The rollout trainers' sequence-parallel generation against TRL's own generate, on 4 gloo ranks.

`LongGRPOTrainer` and `LongRLOOTrainer` with `generation="sp"` (the default: the SP group decodes
the union of its ranks' rows, the cache sharded over it, each rank sampling its own rows with its
own RNG) and with `generation="per-rank"` (TRL's transformers `generate` on gathered, unpatched
weights, each rank its own rows), two steps each from the same seed, with TRL's real sampling
(temperature 0.9, top-k 30, repetition penalty 1.1) and a third of the vocabulary as stop tokens
(ragged lengths): every rank's completions are token for token the same in both modes, so the
steps train on the same rows and log the same loss (fp32: the per-token log-probs the step trains
on are the same computation; 1e-6 relative). On U2×R2 (4 ranks in one SP group, FSDP2) and dp2×U2.
An option sequence-parallel generation does not apply (generation_kwargs={"no_repeat_ngram_size": 2})
is refused when the trainer is built.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.grpo_cases import make_prompts, paths, reward_length  # noqa: F401  (paths: a fixture)
from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import trainer_env


def _two_steps(model_path: str, tok_path: str, out_dir: str, name: str, ulysses: int, ring: int, generation: str) -> dict:
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_longctx import LongGRPOTrainer, LongRLOOTrainer, patch

    trainer_env()
    base = LongGRPOTrainer if name == "GRPO" else LongRLOOTrainer
    seen: list[list[list[int]]] = []

    class Recording(base):
        def _generate_single_turn(self, *args, **kwargs):
            out = super()._generate_single_turn(*args, **kwargs)
            seen.append(out[0] if isinstance(out, tuple) else out)
            return out

    cfg = getattr(trl, f"{name}Config")(
        output_dir=f"{out_dir}/{generation}", max_steps=2, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=10, temperature=0.9, top_k=30, repetition_penalty=1.1, optim="sgd", learning_rate=0.1,
        logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", seed=5, bf16=False,
        gradient_checkpointing=False, beta=0.0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = list(range(1, 41))  # a third of the vocabulary stops: ragged lengths
    mesh = worker_mesh(ulysses, ring)
    trainer = Recording(model=patch(model, mesh), mesh=mesh, reward_funcs=[reward_length], args=cfg,
                        train_dataset=make_prompts(), processing_class=AutoTokenizer.from_pretrained(tok_path),
                        generation=generation)
    trainer.train()
    return {"completions": seen, "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


@pytest.mark.parametrize("name", ["GRPO", "RLOO"])
@pytest.mark.parametrize("ulysses,ring", [(2, 2), (2, 1)])
def test_sp_generation_equals_trl_generate(pools, paths, tmp_path, name, ulysses, ring):  # noqa: F811
    pytest.importorskip("trl")
    model_path, _, tok_path = paths
    runs = {g: pools.get(4).run(_two_steps, model_path, tok_path, str(tmp_path), name, ulysses, ring, g, timeout=400)
            for g in ("sp", "per-rank")}
    for rank, (sp, own) in enumerate(zip(runs["sp"], runs["per-rank"])):
        assert sp["completions"] == own["completions"], (rank, sp["completions"], own["completions"])
        assert sp["loss"] == pytest.approx(own["loss"], rel=1e-6), rank
    lengths = {len(c) for step in runs["sp"][0]["completions"] for c in step}
    assert len(lengths) > 1, lengths


@pytest.mark.parametrize("name", ["GRPO", "RLOO"])
def test_an_option_sp_generation_does_not_apply_is_refused_at_construction(paths, tmp_path, name):  # noqa: F811
    """generation_kwargs that would change the tokens and that sequence-parallel generation does not
    apply raise NotSupported when the trainer is built, naming the option and the per-rank path."""
    pytest.importorskip("trl")
    from tests.helpers.grpo_cases import assert_refused

    assert_refused(paths, tmp_path, name, dict(generation_kwargs={"no_repeat_ngram_size": 2}),
                   r"no_repeat_ngram_size=2(.|\n)*generation='per-rank'")
