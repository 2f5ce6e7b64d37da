"""Typed, validated options of `hf_longctx.patch()`.

Where it sits: `integrations/model_patch.py` builds one `PatchOptions` per `patch()` call
before touching the model, so a bad option raises here, on every rank alike, before any
collective; the object is stored with the patch, so a second `patch()` with equal options
is a no-op. The memory options are FPDT's (§4: KV offload, chunked MLP and loss,
checkpointing), forwarded to `integrations/memory.py` unchanged. Memory presets
(`memory="off" | "balanced" | "high" | "max"`) name bundles of those knobs; FPDT chunks
stay a property of the mesh; `hf-longctx plan` chooses among the same presets."""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_PRESETS = ("off", "balanced", "high", "max")
KNOBS = ("kv_offload", "mlp_chunks", "loss_chunks", "checkpoint")
CHECKPOINT_ATTENTION = "attention"  # checkpoint= value: keep the attention, recompute the rest
# attention_backend= values: the backends of `ops/backends/select.py` (a test holds them equal).
ATTENTION_BACKENDS = ("torch_flash", "torch_flash[FA3]", "torch_flash[FA4]", "flash_attn", "cudnn", "cudnn_frontend",
                      "aten_cpu", "math")


def preset_knobs(memory: str, fpdt_chunks: int) -> dict:
    """The knobs of a memory preset on a mesh with `fpdt_chunks` FPDT chunks:
    "off": nothing; "balanced": chunked LM head + loss and chunked MLP (no recompute of
    attention, no host traffic); "high": those plus checkpointing that keeps the attention
    (checkpoint="attention": layer inputs and the attention's saved tensors on host, the rest
    recomputed); "max": those plus full activation checkpointing (only the layer inputs, on
    host). "high" and "max" add FPDT's K/V offload when the mesh has FPDT chunks."""
    if memory not in MEMORY_PRESETS:
        raise ValueError(f"memory must be one of {MEMORY_PRESETS}, got {memory!r}")
    if memory == "off":
        return {}
    knobs = {"mlp_chunks": "auto", "loss_chunks": "auto"}
    if memory in ("high", "max"):
        knobs.update(checkpoint=CHECKPOINT_ATTENTION if memory == "high" else True, kv_offload=fpdt_chunks > 1)
    return knobs


def _check_chunks(name: str, value) -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be None, 'auto' or a positive int, got {value!r}")


@dataclass(frozen=True)
class PatchOptions:
    """Options of one `patch()` call.

    kv_offload: FPDT offloads K/V chunks to host memory (needs `mesh.fpdt_chunks > 1`).
    mlp_chunks: run every MLP over this many sequence chunks (None = unchunked, "auto" = FPDT's default).
    loss_chunks: compute the LM head + loss over this many sequence chunks (None = unchunked, "auto").
    checkpoint: activation checkpointing of every decoder layer: True recomputes the whole
        layer in the backward; "attention" recomputes everything but the core attention and
        its collectives, whose saved tensors are kept (on the host where the device offloads;
        `integrations/checkpoint_attention.py`).
    memory: the preset these knobs came from (None: set one by one, or nothing).
    inputs_on_device: the last N decoder layers keep their checkpointed inputs on the device
        (not a knob of the presets: it goes with any preset or knobs that checkpoint).
    keep_attention: row-chunked layers (memory="max", or checkpoint=True with mlp_chunks) keep
        each attention call's output and log-sum-exp (on the host where the device offloads) so
        the backward does not run the attention's forward again (not a knob of the presets: it
        goes with memory="max" like inputs_on_device; `integrations/layer_run.py`).
    fused: the elementwise work of every decoder layer (norms, RoPE, the gated MLP's product)
        and of the loss runs as compiled, fused kernels under whichever preset or knobs
        (`integrations/fusion.py`; not a knob of the presets: it goes with any of them).
    loss_chunk_rows: rows per chunk of the chunked LM head (None: `ops/loss_rows.loss_chunk_rows`'
        "auto", at least 2048); `hf-longctx plan` suggests fewer where GPU memory binds. Not a
        knob of the presets: it goes with any setting that chunks the loss, not with a count.
    attention_backend: the local attention kernel every call runs (one of `ATTENTION_BACKENDS`);
        None: the fastest exact one measured on the GPU (`ops/backends/select.py`). A named one
        that cannot run a call (absent, too old, or not exact for its dtype, head dim, softcap
        or window) raises at that call's first layer, before any collective.
    """

    kv_offload: bool = False
    mlp_chunks: int | str | None = None
    loss_chunks: int | str | None = None
    checkpoint: bool | str = False
    memory: str | None = None
    inputs_on_device: int = 0
    keep_attention: bool = False
    fused: bool = False
    loss_chunk_rows: int | None = None
    attention_backend: str | None = None

    @classmethod
    def resolve(cls, memory: str | None, knobs: dict, fpdt_chunks: int, inputs_on_device: int = 0,
                keep_attention: bool = False, fused: bool = False, loss_chunk_rows: int | None = None,
                attention_backend: str | None = None) -> "PatchOptions":
        """Options from `patch()`'s arguments: `knobs` holds only the knobs the caller passed
        explicitly. A preset and an explicit knob together are refused: the preset would
        silently override the knob or the knob the preset."""
        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise TypeError(f"unknown patch() options {unknown}; the memory knobs are {KNOBS}")
        extra = dict(inputs_on_device=inputs_on_device, keep_attention=keep_attention, fused=fused,
                     loss_chunk_rows=loss_chunk_rows, attention_backend=attention_backend)
        if memory is None:
            return cls(**knobs, **extra)
        if knobs:
            raise ValueError(
                f"patch(memory={memory!r}) together with explicit {sorted(knobs)} is ambiguous; pass either a preset "
                f"(memory in {MEMORY_PRESETS}) or the individual knobs"
            )
        return cls(**preset_knobs(memory, fpdt_chunks), memory=memory, **extra)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_offload, bool):
            raise ValueError(f"kv_offload must be True or False, got {self.kv_offload!r}")
        if not (isinstance(self.checkpoint, bool) or self.checkpoint == CHECKPOINT_ATTENTION):
            raise ValueError(
                f"checkpoint must be True (recompute whole layers), {CHECKPOINT_ATTENTION!r} (recompute all but the "
                f"attention) or False, got {self.checkpoint!r}"
            )
        if self.memory is not None and self.memory not in MEMORY_PRESETS:
            raise ValueError(f"memory must be one of {MEMORY_PRESETS}, got {self.memory!r}")
        _check_chunks("mlp_chunks", self.mlp_chunks)
        _check_chunks("loss_chunks", self.loss_chunks)
        n = self.inputs_on_device
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"inputs_on_device must be an int >= 0 (decoder layers), got {n!r}")
        if n and not self.checkpoint:
            raise ValueError(
                f"inputs_on_device={n} keeps checkpointed layer inputs on the device, but checkpointing is off "
                f"(memory={self.memory!r}, checkpoint={self.checkpoint!r}): use memory='high' or 'max' with it, or drop it"
            )

        self._check_keep_attention()
        self._check_attention_backend()
        if not isinstance(self.fused, bool):
            raise ValueError(f"fused must be True or False, got {self.fused!r}")
        self._check_loss_chunk_rows()

    def _check_attention_backend(self) -> None:
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be None (the fastest measured) or one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )

    def _check_loss_chunk_rows(self) -> None:
        r = self.loss_chunk_rows
        if r is None:
            return
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"loss_chunk_rows must be None or an int >= 1 (rows per LM-head chunk), got {r!r}")
        if self.loss_chunks != "auto":
            raise ValueError(
                f"loss_chunk_rows={r} sets the rows of the chunked LM head's \"auto\" chunks, but memory={self.memory!r}, "
                f"loss_chunks={self.loss_chunks!r}: use it with memory='balanced', 'high' or 'max' (or loss_chunks='auto'), "
                "and not with a chunk count"
            )

    def _check_keep_attention(self) -> None:
        if not isinstance(self.keep_attention, bool):
            raise ValueError(f"keep_attention must be True or False, got {self.keep_attention!r}")
        if self.keep_attention and not (self.checkpoint is True and self.mlp_chunks is not None):
            raise ValueError(
                f"keep_attention=True keeps the attention's output and log-sum-exp of row-chunked layers "
                f"(memory='max', or checkpoint=True with mlp_chunks), but memory={self.memory!r}, "
                f"checkpoint={self.checkpoint!r}, mlp_chunks={self.mlp_chunks!r}: use memory='max' with it "
                f"(memory='high' / checkpoint='attention' keeps the attention's saved tensors already)"
            )

    @property
    def uses_memory_options(self) -> bool:
        """True when `integrations/memory.py` has work to do."""
        return self.kv_offload or self.checkpoint or self.mlp_chunks is not None or self.loss_chunks is not None

    def check_mesh(self, fpdt_chunks: int) -> None:
        """Options that need a particular mesh; raises ValueError naming both sides."""
        if self.kv_offload and fpdt_chunks <= 1:
            raise ValueError(
                f"kv_offload=True offloads FPDT key/value chunks, but the mesh has fpdt_chunks={fpdt_chunks}; "
                "build the mesh with init_sequence_parallel(..., fpdt_chunks=N > 1) or pass kv_offload=False"
            )
