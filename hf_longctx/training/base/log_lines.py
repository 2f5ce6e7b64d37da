"""How the trainers print a step's logs: numbers as numbers.

Where it sits: at the very end of a logged optimizer step, after `log()` has put the step's
global figures (loss, grad_norm, tokens_per_s, plan_balance, ...) in the dict that every
`report_to` back end receives. transformers' `ProgressCallback` (the tqdm bar) and
`PrinterCallback` (`disable_tqdm=True`) format each float with `f"{v:.4g}"` and print the
dict, so every value comes out quoted (`{'loss': '6.939', ...}`) and reads as text, and a
token count as `'6.338e+04'`. `use_number_logs(trainer)` swaps both for subclasses that print
the same dict with the numbers unquoted (four significant digits, whole numbers whole); what
is logged (`log_history`, `report_to`) is unchanged.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerControl, TrainerState


def _number(value: float) -> str:
    """4 significant digits, except a whole number (a token count, an epoch), which is shown whole."""
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def format_logs(logs: dict[str, Any], max_str_len: int = 100) -> str:
    """`{'loss': 6.939, 'grad_norm': 1.35, 'step_tokens': 63382, 'plan_layouts': '[4] [2+2]'}`:
    floats with 4 significant digits (whole ones whole), other values as Python prints them;
    `total_flos` left out, as the Trainer's own callbacks do."""
    parts = []
    for key, value in logs.items():
        if key == "total_flos":
            continue
        if isinstance(value, float):
            shown = _number(value)
        elif isinstance(value, str) and len(value) > max_str_len:
            shown = repr(f"[String too long to display, length: {len(value)} > {max_str_len}]")
        else:
            shown = repr(value)
        parts.append(f"{key!r}: {shown}")
    return "{" + ", ".join(parts) + "}"


class NumberProgressCallback(ProgressCallback):
    """The Trainer's progress bar; each log line with its numbers unquoted."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None,
               **kwargs: Any) -> None:
        if state.is_world_process_zero and self.training_bar is not None and logs is not None:
            self.training_bar.write(format_logs(logs, self.max_str_len))


class NumberPrinterCallback(PrinterCallback):
    """The Trainer's printer (`disable_tqdm=True`); each log line with its numbers unquoted."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None,
               **kwargs: Any) -> None:
        if state.is_local_process_zero and logs is not None:
            print(format_logs(logs))


def use_number_logs(trainer: Any) -> None:
    """Replace the trainer's stock progress / printer callback (exactly those classes, not a
    user's subclass) by the ones above, keeping its place in the callback list."""
    handler = trainer.callback_handler
    swap = {ProgressCallback: NumberProgressCallback, PrinterCallback: NumberPrinterCallback}
    for i, callback in enumerate(handler.callbacks):
        new = swap.get(type(callback))
        if new is not None:
            handler.callbacks[i] = new(max_str_len=callback.max_str_len) if new is NumberProgressCallback else new()
