"""What `LongDPOTrainer` does with a dataset that arrives carrying TRL's reference columns.

Where it sits: under `precompute_ref_log_probs=True`, wherever a dataset with
`ref_chosen_logps` / `ref_rejected_logps` reaches the trainer: its construction (train and
eval datasets), `evaluate(eval_dataset=...)` and a step loader's build. Guarantees: columns
with the reference pass's fingerprint are checked against it (`ref_fingerprint.py`; refused
when stale, each dataset hashed once); columns without it are used as given, as TRL uses
them, and said so in ONE warning on rank 0 for all the datasets given at construction (then
once per dataset that arrives later); with `verify_ref_logps=N`, N sampled pairs of each are
rescored by the reference and compared (`ref_verify.py`) instead. Every decision is the same
on every rank (same data, same digest, same sample), so a refusal never splits the ranks."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from hf_longctx.training.base.mesh_source import process_rank
from hf_longctx.training.dpo.ref_columns import REF_COLUMNS
from hf_longctx.training.dpo.ref_fingerprint import check_fingerprint
from hf_longctx.training.dpo.ref_verify import unverified_message, verify_stored
from hf_longctx.training.refusals.dpo import refuse_dpo


def _key(dataset: Any) -> Any:
    """A dataset's content fingerprint (`datasets` keeps one per transform), else its object."""
    return getattr(dataset, "_fingerprint", None) or id(dataset)


class StoredRefColumns:
    """The stored-column policy of one trainer. `digest`: the reference's `model_digest`;
    `reference`: how messages name it; `verify`: pairs to rescore per dataset (0: none);
    `seed`: the sample's seed."""

    def __init__(self, *, digest: int, reference: str, verify: int, seed: int) -> None:
        self.digest, self.reference, self.verify, self.seed = digest, reference, verify, seed
        self._checked: set[Any] = set()  # datasets whose fingerprint matched
        self._warned: set[Any] = set()  # datasets said to be unverified
        self._pending: list[str] | None = []  # their names while the trainer is built: one warning for all

    def check(self, dataset: Any, name: str) -> bool:
        """True: fingerprinted and valid; False: no fingerprint. Raises when stale."""
        key = _key(dataset)
        if key in self._checked:
            return True
        fingerprinted = check_fingerprint(dataset, name, self.digest, self.reference)
        if fingerprinted:
            self._checked.add(key)
        return fingerprinted

    def accept(self, dataset: Any, name: str, *, score: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None,
               dtype: torch.dtype | None) -> None:
        """Check `dataset`'s stored columns, rescore a sample with `score` (None: the reference is
        no longer held) in `dtype` when asked, or note them as unverified."""
        fingerprinted = self.check(dataset, name)
        if not self.verify:
            if not fingerprinted:
                self.unverified(dataset, name)
            return
        if score is None:
            if fingerprinted:  # its fingerprint matched; the reference that could rescore it is gone
                return
            refuse_dpo(f"verify_ref_logps={self.verify} asks to rescore {name}'s stored {REF_COLUMNS}, which carry no "
                       "fingerprint, and the reference is no longer held (precompute_ref_log_probs=True releases it "
                       "after scoring the datasets given at construction)",
                       "pass this dataset as eval_dataset= when building the trainer (it is rescored there)")
        verify_stored(dataset, name, count=self.verify, seed=self.seed, dtype=dtype, score=score)

    def unverified(self, dataset: Any, name: str) -> None:
        """Say once per dataset that its columns are used unverified (collected during construction)."""
        key = _key(dataset)
        if key in self._warned:
            return
        self._warned.add(key)
        if self._pending is not None:
            self._pending.append(name)
        else:
            self._warn([name])

    def constructed(self) -> None:
        """The trainer is built: one warning for every dataset given to it unverified."""
        names, self._pending = self._pending or [], None
        if names:
            self._warn(names)

    @staticmethod
    def _warn(names: list[str]) -> None:
        if process_rank() == 0:
            warnings.warn(unverified_message(names), stacklevel=5)
