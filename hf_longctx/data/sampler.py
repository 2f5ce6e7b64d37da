"""Step sampler: the global list of documents of every training step.

Where it sits: between the tokenized dataset (`data/pipeline.py`, which adds a `length`
column) and the micro-batch planner (`data/packing.py`). Every rank builds the same sampler
from the same lengths and seed, so it draws the same global list for every step without
communication (invariant 8); the planner then gives DP ranks different documents and an SP
group's ranks the same ones. The step is a token budget, not a document count (Hydraulis'
and FlexSP's per-step global batch): documents vary by orders of magnitude in length."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from hf_longctx.data.pieces import as_lengths


def _lengths_array(lengths: Any) -> np.ndarray:
    return as_lengths(lengths, hint=" (filter empty texts, or tokenize with add_eos=True)")


class StepSampler:
    """Yields, step after step, the dataset indices of one step's documents.

    Each epoch visits every document once, in a seeded order (`shuffle=True`) or in
    dataset order. Documents are taken in that order until the next one would push the
    step past `tokens_per_step`; a single document longer than the budget forms a step
    of its own (the planner then splits, truncates or rejects it as it was told). With
    `drop_last=True` the epoch's final step, cut short because documents ran out, is
    left out; otherwise every document is yielded.

    The order depends only on (seed, epoch), so every rank yields identical steps.
    Iterating runs from the saved position to the end of the epoch and then moves to
    the next epoch; `state_dict()` taken between steps resumes exactly at the next one.

    Args:
        lengths: Every document's token count, in dataset order (e.g. the `length` column
            of `tokenize_dataset`).
        tokens_per_step: The global token budget of one step.
        seed: Seeds the order (with the epoch).
        shuffle: Visit the documents in a seeded order (False: dataset order).
        drop_last: Leave out the epoch's final, short step.

    Raises:
        ValueError: `tokens_per_step` is not a positive int, `seed` is negative, or a
            length is not a positive int.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        tokens_per_step: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, (int, np.integer)) or tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be a positive integer, got {tokens_per_step!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.lengths = _lengths_array(lengths)
        self.tokens_per_step = int(tokens_per_step)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._epoch = 0
        self._step = 0
        self._cache: tuple[int, list[np.ndarray]] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next step is drawn from."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of `epoch`; the current epoch keeps its position, so calling
        this after `load_state_dict` with the same epoch does not lose the resume point."""
        if epoch != self._epoch:
            self._epoch, self._step = int(epoch), 0

    def epoch_steps(self, epoch: int) -> list[np.ndarray]:
        """All steps of `epoch`, each an int64 array of dataset indices."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n = len(self.lengths)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        else:
            order = np.arange(n)
        cum = np.cumsum(self.lengths[order])
        steps, start = [], 0
        while start < n:
            before = int(cum[start - 1]) if start else 0
            end = int(np.searchsorted(cum, before + self.tokens_per_step, side="right"))
            end = max(end, start + 1)  # an over-budget document still gets a step
            steps.append(order[start:end])
            start = end
        if self.drop_last and steps:
            steps.pop()
        self._cache = (epoch, steps)
        return steps

    def __len__(self) -> int:
        """Steps in the current epoch (from its start, not from the saved position)."""
        return len(self.epoch_steps(self._epoch))

    def __iter__(self) -> Iterator[list[int]]:
        steps = self.epoch_steps(self._epoch)
        if steps and self._step >= len(steps):
            # A state saved right after an epoch's last step points past its end (the
            # generator that would roll over was never resumed): start the next epoch.
            self._epoch, self._step = self._epoch + 1, 0
            steps = self.epoch_steps(self._epoch)
        while self._step < len(steps):
            step = steps[self._step]
            self._step += 1
            yield step.tolist()
        self._epoch, self._step = self._epoch + 1, 0

    def state_dict(self) -> dict[str, int | bool]:
        """The sampler's position (epoch, step) and the settings a resume must match."""
        return {
            "epoch": self._epoch,
            "step": self._step,
            "seed": self.seed,
            "tokens_per_step": self.tokens_per_step,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "num_documents": len(self.lengths),
            "total_tokens": int(self.lengths.sum()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved step. The sampler must be built from the same lengths and
        settings: a mismatch would silently yield different documents, so it raises."""
        mine = self.state_dict()
        wrong = [f"{k}: saved {state.get(k)!r}, here {mine[k]!r}" for k in mine if k not in ("epoch", "step") and state.get(k) != mine[k]]
        if wrong:
            raise ValueError("StepSampler state does not match this sampler: " + "; ".join(wrong))
        self._epoch, self._step = int(state["epoch"]), int(state["step"])


def group_stream(
    examples: Iterable[dict[str, Any]], *, tokens_per_step: int, length_key: str = "length"
) -> Iterator[list[dict[str, Any]]]:
    """Group a stream (e.g. a tokenized `IterableDataset`) into steps under the same token
    budget as `StepSampler`, in stream order; the last short step is yielded too.

    Every rank that reads the same stream in the same order gets the same steps;
    shuffle the stream itself (`IterableDataset.shuffle(seed=...)`) for randomness.

    Args:
        examples: The stream of examples, each with its token count under `length_key`.
        tokens_per_step: The global token budget of one step.
        length_key: The field holding each example's token count.

    Yields:
        The examples of one step, in stream order.

    Raises:
        ValueError: `tokens_per_step` is not a positive int, or an example has no
            positive length under `length_key`.
    """
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be a positive integer, got {tokens_per_step!r}")
    step: list[dict[str, Any]] = []
    used = 0
    for i, example in enumerate(examples):
        if length_key not in example:
            raise ValueError(f"example {i} has no {length_key!r} field (keys: {sorted(example)})")
        n = int(example[length_key])
        if n < 1:
            raise ValueError(f"every document needs at least 1 token: example {i} has length {n}")
        if step and used + n > tokens_per_step:
            yield step
            step, used = [], 0
        step.append(example)
        used += n
    if step:
        yield step
