"""What one `patch()` call installed on a model, kept on the model itself.

Where it sits: `integrations/model_patch.patch` builds one `PatchState` per call and keeps it
as a plain instance attribute of the HF model (`STATE_ATTR`: not a submodule, not in the
state_dict); the registered attention (`attention.py`), the forward hooks
(`forward_hooks.py`) and the memory options read and update it per batch. Guarantees: it
holds every change `patch()` made (registration name, each config's former attention
implementation, hooks, the memory options' undo, the mixer wrappers), so `unpatch()` restores
exactly those; no module globals: all a patch binds lives here. `patch_state(model)` and
`is_patched(model)` are how every other module reads it (the data stage, a floor below, through
`model_walk.installed_patch`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from hf_longctx.config import PatchOptions
from hf_longctx.data.multimodal.spec import VisionSpec
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.flex.bank import GroupBank
from hf_longctx.integrations.attention_route import AttentionRoute
from hf_longctx.integrations.checkpoint_attention import AttentionKeeper
from hf_longctx.integrations.mixers.binding import MixerBinding
from hf_longctx.integrations.probe.report import ProbeReport
from hf_longctx.model_walk import PATCH_STATE_ATTR as STATE_ATTR  # noqa: F401  (re-exported: the attribute on the patched model)
from hf_longctx.model_walk import installed_patch


class InstallPlan(NamedTuple):
    """What `patch()`'s checks decided and `patch_install.install` puts on the model -- again after
    `model_patch.suspended`, without checking the model again."""

    # integrations/vision/binding.VisionBinding (named, not imported: that module types its hook's
    # binding as PatchState): the tower's configs kept, the family and its spec, or none of them
    vision: Any
    mixer_plan: list  # integrations/mixers/registry.plan_mixers: (name, module, adapter) per linear mixer
    mixer_modes: dict  # and the modes it chose


@dataclass
class PatchState:
    """Everything one `patch()` call changed, so that `unpatch()` can undo exactly that."""

    name: str
    mesh: SPMesh
    options: PatchOptions
    # What patch() was given: a GroupBank, or an SPMesh (a bank of its one group size); each
    # batch names its group in it (SPBatchInfo.group). `mesh` is its patch_mesh.
    bank: SPMesh | GroupBank
    explicit: frozenset = frozenset()  # the knobs the last patch() call was given by name (not from a preset)
    saved_impls: list = field(default_factory=list)  # [(config, original _attn_implementation_internal)]
    hooks: list = field(default_factory=list)
    memory_undo: Callable[[], None] | None = None
    fusion: Any = None  # integrations/fusion.Fusion of patch(fused=True), or None
    fusion_undo: list = field(default_factory=list)  # its instance attributes, undone after the memory options'
    probe: ProbeReport | None = None  # patch()'s dry run (None under unsafe_skip_exactness_check)
    mixers: MixerBinding | None = None  # the wrapped linear mixers, or None
    mixers_option: Any = None  # patch(mixers=...) as given (re-patches pass it on)
    calls: int = 0  # attention calls in the current forward
    # The sliding window a model applies through its masks alone (PhiMoE: every mask carries
    # the same window, the attention gets none; HF's sdpa/eager paths apply it through the
    # mask), read from the dry run's masks; without a dry run (unsafe_skip_exactness_check)
    # from the masks of each forward (`mask_windows`, one frozenset per mask built).
    mask_window: int | None = None
    mask_windows: list = field(default_factory=list)
    # Ring plans of the current batch, keyed by boundaries (so a stale entry is never wrong):
    # every layer of a micro-batch shares one plan instead of re-planning per layer.
    plan_cache: dict = field(default_factory=dict)
    checked: bool = False  # the first micro-batch's consistency check ran (later ones keep the host free)
    keeper: AttentionKeeper | None = None  # under checkpoint="attention", else None
    # integrations/layer_split.LayerSplit under checkpoint=True, else None (named, not imported: that module
    # types its binding as PatchState, and an import back would be a circle)
    split: Any = None
    generation: Any = None  # integrations/generation_binding.GenerationBinding while a rollout generates, else None
    install_plan: InstallPlan | None = None  # what patch()'s checks decided: `patch_install.install` installs it

    @property
    def vision(self) -> Any:
        """The vision family adapter (`integrations/vision/families`) of an image-text-to-text
        model, else None."""
        return self.install_plan.vision.family if self.install_plan is not None else None

    @property
    def vision_spec(self) -> VisionSpec | None:
        """That adapter's spec (the data stage reads it), else None."""
        return self.install_plan.vision.spec if self.install_plan is not None else None

    @property
    def route(self) -> AttentionRoute | None:
        """What the checkpoint mode does with each attention call (`attention_route.py`): the
        keeper under checkpoint="attention", the split under checkpoint=True, else None."""
        return self.keeper if self.keeper is not None else self.split


def patch_state(model: Any) -> PatchState | None:
    """The patch of `model` (its mesh, bank, options and dry-run report), or None when it is
    not patched. Read-only for callers."""
    return installed_patch(model)


def is_patched(model: Any) -> bool:
    """True while `model` is patched.

    Args:
        model: A model (or PEFT model).

    Returns:
        Whether `patch()` is in effect on it.
    """
    return installed_patch(model) is not None
