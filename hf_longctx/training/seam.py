"""The Trainer seam: every transformers / TRL member the trainers override, call or touch.

Where it sits: beside the trainers of `training/` (`SPTrainerBase`, `LongContextTrainerMixin`,
`LongDPOTrainer`, `SPRolloutTrainer`, `LongGRPOTrainer`, `LongRLOOTrainer`) and the callbacks of
`base/log_lines.py`, `base/faults.py` and `grpo/resume.py`; nothing imports it at run time. Each `Hook` names our
class, the library classes whose member it is, what we do with it (override, call, read,
write), the parameters the code relies on (leading, in order), and why no public extension
point does it. `tests/unit/test_trainer_seam.py` checks every entry against the installed
transformers and TRL (the method's signature, the attribute in the parent's source) and fails
naming it, and fails on any override or parent-private attribute found in the code but not
listed here. DESIGN "The Trainer seam" says which hooks could still go.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINER = ("transformers.Trainer",)
ALL_TRL = ("transformers.Trainer", "trl.SFTTrainer", "trl.DPOTrainer", "trl.GRPOTrainer", "trl.RLOOTrainer")
SFT = ("transformers.Trainer", "trl.SFTTrainer")
ROLLOUT = ("trl.GRPOTrainer", "trl.RLOOTrainer")
STEP = ("transformers.Trainer", "trl.GRPOTrainer", "trl.RLOOTrainer")  # TRL's SFT / DPO wrap it as (*args, **kwargs)


@dataclass(frozen=True)
class Hook:
    """One member of a library trainer or callback that our code overrides or touches.

    Attributes:
        ours: Our class (`SPTrainerBase`, ...).
        name: The member's name.
        parents: The library classes (module.Class) the member is resolved on.
        kind: "override", "call" (a parent's method we call), "read" or "write" (an attribute).
        params: The parent method's parameters our code relies on, leading and in order.
        why: What it does here, and why no public extension point does it.
    """

    ours: str
    name: str
    parents: tuple[str, ...]
    kind: str
    params: tuple[str, ...] = ()
    why: str = ""

    @property
    def private(self) -> bool:
        return self.name.startswith("_") and not self.name.startswith("__")


def _o(ours: str, name: str, parents: tuple[str, ...], params: tuple[str, ...], why: str) -> Hook:
    return Hook(ours, name, parents, "override", params, why)


_SAVE = "no public point sits between the Trainer's checkpoint steps (callbacks' on_save runs after them)"

HOOKS: tuple[Hook, ...] = (
    # ---- SPTrainerBase: what every trainer needs under SP (base/trainer.py) -----------------------
    _o("SPTrainerBase", "create_accelerator_and_postprocess", ALL_TRL, (),
       "public: the launcher's parallelism config is hidden while the Accelerator is built"),
    _o("SPTrainerBase", "train", ALL_TRL, ("resume_from_checkpoint",),
       "public: resume_from_checkpoint=True takes the newest COMPLETE checkpoint"),
    _o("SPTrainerBase", "save_model", ALL_TRL, ("output_dir", "_internal_call"),
       "public: the consolidated model; inside a checkpoint the sharded states stand for it"),
    _o("SPTrainerBase", "push_to_hub", TRAINER, (),
       "public: the consolidated model saved to output_dir first (the Trainer's own save inside is the "
       "checkpoint's, which gathers nothing)"),
    _o("SPTrainerBase", "_move_model_to_device", TRAINER, ("model", "device"),
       "a sharded model stays where fully_shard put it; the only public switches are "
       "TrainingArguments.place_model_on_device (a property without a setter) and a model sharded "
       "at load time (for which the Trainer refuses checkpoints)"),
    _o("SPTrainerBase", "_clip_grad_norm", TRAINER, ("model",),
       "the norm of the SUMMED DTensor gradient under comm_guard (a dead rank named with the step); "
       "the Trainer's only other path is the accelerator's clip, without either (max_grad_norm <= 0 reaches "
       "the Trainer as inf, so it runs every step)"),
    _o("SPTrainerBase", "_save_checkpoint", ALL_TRL, ("model", "trial"),
       "the folder is marked unfinished before any rank writes and complete after every rank's files, "
       "the Trainer's rotation off inside; " + _SAVE),
    _o("SPTrainerBase", "_save_optimizer_and_scheduler", TRAINER, ("output_dir",),
       "every rank writes its DCP shards (the Trainer writes rank 0's optimizer state only); " + _SAVE),
    _o("SPTrainerBase", "_load_optimizer_and_scheduler", ("transformers.Trainer", "trl.GRPOTrainer"), ("checkpoint",),
       "the shards, the weights with them, and the step sampler's position, read back"),
    _o("SPTrainerBase", "_load_from_checkpoint", TRAINER, ("resume_from_checkpoint", "model"),
       "a no-op: the weights come with the shards; the Trainer's would refuse a folder without a weights file"),
    Hook("SPTrainerBase", "_get_learning_rate", TRAINER, "call", (),
         "LOMO / AdaLomo update inside the backward at the current rate, as Trainer.training_step does"),
    Hook("SPTrainerBase", "_push_from_checkpoint", TRAINER, "call", ("checkpoint_folder",),
         "push_to_hub's upload of a checkpoint, run after the folder is marked complete and the consolidated "
         "model saved beside it (inside `_save_checkpoint` it would run before both)"),
    Hook("SPTrainerBase", "_get_output_dir", TRAINER, "call", ("trial",),
         "the checkpoint folder exactly as Trainer._save_checkpoint names it"),
    Hook("SPTrainerBase", "_prepare_inputs", TRAINER, "call", ("inputs",),
         "`_micro_inputs`' default (the token step's; the rollout trainers shard their slot in their own "
         "`_micro_inputs`)"),
    Hook("SPTrainerBase", "is_distributed_loading_by_transformers", TRAINER, "write", (),
         "the model owns placement and reduction (no DDP); set after __init__, since a model carrying it "
         "makes the Trainer refuse checkpoints"),
    # ---- LongContextTrainerMixin: the token step (sft/trainer.py) --------------------------------
    _o("LongContextTrainerMixin", "__init__", SFT, ("model", "args"),
       "public: the mesh, the checks before any collective, the collators and the step loop"),
    _o("LongContextTrainerMixin", "get_train_dataloader", TRAINER, (), "public: one StepBatch per optimizer step"),
    _o("LongContextTrainerMixin", "get_eval_dataloader", TRAINER, ("eval_dataset",), "public: the eval steps"),
    _o("LongContextTrainerMixin", "get_batch_samples", TRAINER, ("epoch_iterator", "num_batches", "device"),
       "public: the step's normaliser travels in its micro-batches; no per-rank count and gather"),
    _o("LongContextTrainerMixin", "training_step", TRAINER, ("model", "inputs", "num_items_in_batch"),
       "public: the step's micro-batches through the shared step loop"),
    _o("LongContextTrainerMixin", "compute_loss", TRAINER, ("model", "inputs", "return_outputs", "num_items_in_batch"),
       "public: the model's loss as is (no num_processes factor)"),
    _o("LongContextTrainerMixin", "floating_point_ops", TRAINER, ("inputs",), "public: this rank's share of the step's FLOPs"),
    _o("LongContextTrainerMixin", "log", (*SFT, "trl.DPOTrainer"), ("logs", "start_time"),
       "public: the step's global loss and figures"),
    _o("LongContextTrainerMixin", "evaluation_loop", TRAINER,
       ("dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix"),
       "public: Σ token losses / Σ targets over the eval set"),
    _o("LongContextTrainerMixin", "_track_num_input_tokens", TRAINER, ("inputs",),
       "the Trainer counts a dict's input_ids and gathers them over processes; a StepBatch's count is "
       "global already (and no public point counts tokens)"),
    Hook("LongContextTrainerMixin", "_metrics", ("trl.SFTTrainer",), "read",
         why="TRL's metric store: entropy, mean_token_accuracy and num_tokens appended as global values"),
    Hook("LongContextTrainerMixin", "_total_train_tokens", ("trl.SFTTrainer",), "write",
         why="TRL's running token count, advanced by the step's global tokens once"),
    # ---- LongDPOTrainer: pairs and the DPO objective (dpo/trainer.py) ----------------------------
    _o("LongDPOTrainer", "__init__", ("trl.DPOTrainer",), ("model", "ref_model", "args"),
       "public: the reference placed like the policy, the pair collate, the precomputed columns"),
    _o("LongDPOTrainer", "_precompute_ref_logps", ("trl.DPOTrainer",), ("dataset", "name", "batch_size"),
       "TRL's only hook for the stored reference columns (its __init__ and evaluate call it): the SP "
       "reference pass, deferred until the model is placed"),
    _o("LongDPOTrainer", "_prepare_dataset", ("trl.DPOTrainer",),
       ("dataset", "processing_class", "args", "dataset_name"),
       "TRL's only data hook: token-id pairs become TRL's tokenized columns; text goes to TRL unchanged"),
    _o("LongDPOTrainer", "get_train_dataloader", TRAINER, (), "public: steps of pairs"),
    _o("LongDPOTrainer", "get_eval_dataloader", TRAINER, ("eval_dataset",), "public: eval steps of pairs"),
    _o("LongDPOTrainer", "evaluation_loop", TRAINER,
       ("dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix"),
       "public: the mixin's loop plus the metric sums over the eval set"),
    _o("LongDPOTrainer", "compute_loss", TRAINER, ("model", "inputs", "return_outputs", "num_items_in_batch"),
       "public: DPO on per-document sums"),
    _o("LongDPOTrainer", "training_step", TRAINER, ("model", "inputs", "num_items_in_batch"),
       "public: the step, then TRL's metrics as global means"),
    Hook("LongDPOTrainer", "_metrics", ("trl.DPOTrainer",), "read",
         why="TRL's metric store: rewards, logps, logits and token metrics appended as global means"),
    Hook("LongDPOTrainer", "_total_train_tokens", ("trl.DPOTrainer",), "write",
         why="TRL's running token count, advanced by both documents of every pair once"),
    # ---- SPRolloutTrainer, LongGRPOTrainer, LongRLOOTrainer (grpo/, rloo/) -----------------------
    _o("SPRolloutTrainer", "__init__", ROLLOUT, ("model", "reward_funcs", "args"),
       "public: the checks before any collective, placement of policy and reference"),
    _o("SPRolloutTrainer", "_generate_single_turn", ROLLOUT, (),
       "TRL's generation on gathered, unpatched weights; TRL has no public generation hook"),
    _o("SPRolloutTrainer", "evaluate", ROLLOUT, (),
       "public: refused (evaluation rollouts are not wired to the SP step)"),
    _o("SPRolloutTrainer", "predict", ROLLOUT, (), "public: refused, as evaluate"),
    _o("SPRolloutTrainer", "compute_loss", ROLLOUT, ("model", "inputs", "return_outputs", "num_items_in_batch"),
       "public: the objective on the shard"),
    _o("SPRolloutTrainer", "training_step", STEP, ("model", "inputs", "num_items_in_batch"),
       "public: generation and scoring once, the packed micro-batches through the step loop"),
    _o("SPRolloutTrainer", "log", ROLLOUT, ("logs", "start_time"), "public: tokens_per_s of the whole world"),
    _o("SPRolloutTrainer", "_get_train_sampler", ROLLOUT, ("dataset",),
       "TRL's RepeatSampler made resumable (it has no set_epoch)"),
    Hook("SPRolloutTrainer", "_generate_and_score_completions", ROLLOUT, "call", ("inputs",),
         "TRL's rollout pipeline (generation, rewards, advantages), kept whole"),
    Hook("SPRolloutTrainer", "_metrics", ROLLOUT, "read", why="TRL's metric store: the step's merged metrics"),
    Hook("SPRolloutTrainer", "_step", ROLLOUT, "write",
         why="TRL's count of training_step calls, advanced once per optimizer step"),
    _o("LongGRPOTrainer", "_get_per_token_logps_and_entropies", ("trl.GRPOTrainer",), (),
       "TRL's padded-batch pass switched off: the reference's log-probs come from the SP shard"),
    _o("LongRLOOTrainer", "_get_per_token_logps_and_entropies", ("trl.RLOOTrainer",),
       ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy", "compute_aux_loss"),
       "TRL's scoring hook computed on the SP shards and handed back as its [B, C]"),
    # ---- callbacks (base/log_lines.py, base/faults.py, grpo/resume.py): public events ---------------
    _o("NumberProgressCallback", "on_log", ("transformers.ProgressCallback",), ("args", "state", "control", "logs"),
       "public: the log line with its numbers unquoted"),
    _o("NumberPrinterCallback", "on_log", ("transformers.PrinterCallback",), ("args", "state", "control", "logs"),
       "public: the log line with its numbers unquoted"),
    _o("WatchdogCallback", "on_train_begin", ("transformers.TrainerCallback",), ("args", "state", "control"),
       "public: the watchdog thread starts"),
    _o("WatchdogCallback", "on_step_end", ("transformers.TrainerCallback",), ("args", "state", "control"),
       "public: a beat per optimizer step"),
    _o("RolloutResumeCallback", "on_train_begin", ("transformers.TrainerCallback",), ("args", "state", "control"),
       "public: TRL's sampler epoch and training-step count set from the restored state, before the first step"),
    _o("WatchdogCallback", "on_train_end", ("transformers.TrainerCallback",), ("args", "state", "control"),
       "public: the watchdog thread stops"),
)
