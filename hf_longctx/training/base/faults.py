"""Faults: a dead or hung rank becomes a clear error on every other rank, within a timeout.

Where it sits: around `LongContextTrainerMixin.training_step`, its gradient-norm collective,
evaluation and checkpoint saving. Under FSDP + USP every rank joins every collective, so one
dead rank blocks the others. Three layers stop them: the process-group timeout
(`training/launch.init_distributed(timeout_s=...)`), past which gloo raises from a blocked
collective; `comm_guard`, which turns that backend error into `RankFailure` naming this
rank, the step and the timeout; and the optional `Watchdog` thread (run by
`WatchdogCallback` for `Trainer.train()`, beaten after every micro-batch), which ends the
process with a clear message when a step makes no progress for `timeout_s`."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator

import torch.distributed as dist

EXIT_CODE = 3  # the Watchdog's exit status; distinguishable from a Python error (1) or a kill
_COMM_HINTS = ("connection", "timed out", "timeout", "closed", "reset by peer", "gloo", "nccl", "broken pipe", "socket")


class RankFailure(RuntimeError):
    """A collective failed or timed out: a peer rank died, hung or lost its connection."""


def _is_comm_error(err: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    return isinstance(err, RuntimeError) and any(h in str(err).lower() for h in _COMM_HINTS)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def comm_guard(step: int, timeout_s: float | None = None) -> Iterator[None]:
    """Re-raise a communication failure inside the block as `RankFailure` with context."""
    try:
        yield
    except RankFailure:
        raise
    except Exception as err:  # noqa: BLE001 - only comm errors are rewrapped, others pass through
        if not _is_comm_error(err):
            raise
        limit = f"{timeout_s:g}s" if timeout_s else "the process-group timeout"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RankFailure(
            f"hf_longctx: rank {_rank()} stopped at step {step}: a collective failed or did not finish within "
            f"{limit} -- another rank died, hung or lost its connection. Every rank stops; check the first "
            f"failing rank's log, then resume from the last checkpoint. Backend error: {first}"
        ) from err


class Watchdog:
    """Exit the process with a clear message when `beat()` is not called for `timeout_s`.

    Use as a context manager around the training loop; call `beat(step)` whenever work
    completes (every micro-batch). `on_expire` exists for tests; by default it prints to
    stderr and calls `os._exit(EXIT_CODE)`: a hung collective cannot be interrupted from
    Python, so leaving the process is the only way out.
    """

    def __init__(self, timeout_s: float, *, on_expire=None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._on_expire = on_expire
        self._last = time.monotonic()
        self._step = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._paused = 0

    def beat(self, step: int) -> None:
        self._last, self._step = time.monotonic(), step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No expiry inside (a checkpoint write: one long operation with no step to beat on;
        its collectives are still bounded by the process-group timeout); the clock restarts
        on exit."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    def _expire(self) -> None:
        msg = (
            f"hf_longctx: rank {_rank()} made no progress for {self.timeout_s:g}s (last step {self._step}); "
            "another rank probably died or hangs in a collective. Stopping this rank."
        )
        if self._on_expire is not None:
            self._on_expire(msg)
            return
        print(msg, file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            if not self._paused and time.monotonic() - self._last > self.timeout_s:
                self._expire()
                return

    def __enter__(self) -> "Watchdog":
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="hf_longctx-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class WatchdogCallback(_trainer_callback_base()):
    """A `Watchdog` over `Trainer.train()`: started at train begin, beaten at every step end (and
    by the trainer after every training and evaluation micro-batch), paused while checkpoints
    are written, stopped at train end."""

    def __init__(self, timeout_s: float, *, on_expire=None) -> None:
        self.timeout_s = float(timeout_s)
        self._on_expire = on_expire
        self._dog: Watchdog | None = None

    def beat(self, step: int) -> None:
        if self._dog is not None:
            self._dog.beat(step)

    def paused(self):
        return self._dog.paused() if self._dog is not None else contextlib.nullcontext()

    def on_train_begin(self, args, state, control, **kwargs):
        self._dog = Watchdog(self.timeout_s, on_expire=self._on_expire).__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.beat(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._dog is not None:
            self._dog.__exit__(None, None, None)
            self._dog = None
