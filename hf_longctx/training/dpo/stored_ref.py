"""What `LongDPOTrainer` does with a dataset that arrives carrying TRL's reference columns.

Where it sits: under `precompute_ref_log_probs=True`, wherever a dataset with
`ref_chosen_logps` / `ref_rejected_logps` reaches the trainer: its construction (train and
eval datasets), `evaluate(eval_dataset=...)` and a step loader's build. Guarantees: columns
with the reference pass's fingerprint are checked against it (`ref_fingerprint.py`; refused
when stale, each dataset hashed once); columns without it are used as given, as TRL uses
them. Every decision is the same on every rank (same data, same digest), so a refusal never
splits the ranks."""

from __future__ import annotations

from typing import Any

from hf_longctx.training.dpo.ref_fingerprint import check_fingerprint


def _key(dataset: Any) -> Any:
    """A dataset's content fingerprint (`datasets` keeps one per transform), else its object."""
    return getattr(dataset, "_fingerprint", None) or id(dataset)


class StoredRefColumns:
    """The stored-column policy of one trainer. `digest`: the reference's `model_digest`;
    `reference`: how messages name it."""

    def __init__(self, *, digest: int, reference: str) -> None:
        self.digest, self.reference = digest, reference
        self._checked: set[Any] = set()  # datasets whose fingerprint matched

    def check(self, dataset: Any, name: str) -> bool:
        """True: fingerprinted and valid; False: no fingerprint. Raises when stale."""
        key = _key(dataset)
        if key in self._checked:
            return True
        fingerprinted = check_fingerprint(dataset, name, self.digest, self.reference)
        if fingerprinted:
            self._checked.add(key)
        return fingerprinted
