"""The structural exactness rule (the dry run): prove, per model, that only our attention mixes tokens.

Where it sits: called by `exactness.refuse_inexact` inside `patch()`, before anything is
changed and before any collective. Invariant 7 holds iff every module that mixes tokens does
it through our attention function, and everything that function receives is something it
applies. Deny by default: the model is run locally on a tiny packed probe with a PER-TOKEN
attention stand-in; a module whose output changes at another position (one token
perturbed), or on a suffix that starts mid-document, mixes tokens or depends on the shard;
unknown attention inputs, a dropped `sp_batch` and unsupported mask pieces refuse. Leaks are
blamed at the innermost module and spliced back (`tracing.py`), so one pass finds every
source; `handled` classes are trusted. Nothing of the model is changed. Runs and cost: docs/DESIGN.md
"Decisions and why"."""

from __future__ import annotations

import uuid

import torch

from hf_longctx.integrations.probe.inputs import (
    loss_ignores_shift_labels,
    no_shift_labels,
    per_token,
    probe_lengths,
    shift_label_pair,
)
from hf_longctx.integrations.probe.masks import mask_pieces
from hf_longctx.integrations.probe.report import ProbeReport
from hf_longctx.integrations.probe.tracing import RunTracer
from hf_longctx.model_walk import SkippedLayer, configs, decoder_layers, layer_kind, reduced_copy


def probe_model(
    hf, metadata_key: str, used_kwargs: frozenset, ignored_kwargs: frozenset, handled: frozenset = frozenset()
) -> ProbeReport:
    """Dry-run `hf` (a PreTrainedModel) with a per-token attention; see the module docstring."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    report = ProbeReport()
    p0 = next(hf.parameters(), None)
    if p0 is None:
        report.problems.append(f"{type(hf).__name__} has no parameters to probe")
        return report
    if p0.device.type == "meta":
        return _probe_meta(hf, metadata_key, used_kwargs, ignored_kwargs, handled)
    ids, pos, perturbed, a = _probe_batch(hf, p0.device)
    tracer = RunTracer(hf, report, ids.shape[1], a, handled)
    marker = object()
    calls: list[torch.nn.Module] = []  # the attention module of every call of the current run
    mask_fns: list = []
    stand_in = _stand_in(report, tracer, calls, metadata_key, marker, used_kwargs, ignored_kwargs)

    def mask_fn(mask_function=None, attention_mask=None, **_):
        mask_fns.append(mask_function)
        return None  # as the real patch: the attention builds the document mask itself

    name = f"hf_longctx_probe_{uuid.uuid4().hex[:12]}"
    saved_impls = [(cfg, getattr(cfg, "_attn_implementation_internal", None)) for cfg in configs(hf)]
    modes = [(m, m.training) for m in hf.modules()]
    AttentionInterface.register(name, stand_in)
    AttentionMaskInterface.register(name, mask_fn)
    rng = torch.get_rng_state()
    try:
        hf.set_attn_implementation(name)
        hf.eval()
        tracer.attach()
        _run_forwards(hf, tracer, calls, report, ids, pos, perturbed, a, {metadata_key: marker, "use_cache": False})
    except Exception as e:  # noqa: BLE001 -- every failure of the dry run is a refusal with its cause
        report.problems.extend(_failure_problems(tracer, e))
    finally:
        tracer.detach()
        for cfg, original in saved_impls:
            cfg._attn_implementation_internal = original
        for m, mode in modes:
            m.training = mode
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
        torch.set_rng_state(rng)
    _read_masks(report, mask_fns)
    return report


def _probe_batch(hf, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(ids, position ids, ids with token 1 perturbed, shard start a): two packed documents
    of the probe lengths, drawn from a local generator (the global RNG is untouched)."""
    l0, l1, a = probe_lengths(hf)
    s = l0 + l1
    vocab = hf.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(1234)  # a local generator: the global RNG is untouched
    ids = torch.randint(min(4, vocab - 1), vocab, (1, s), generator=gen).to(device)
    pos = torch.cat([torch.arange(l0), torch.arange(l1)]).unsqueeze(0).to(device)  # [1, S]
    perturbed = ids.clone()
    perturbed[0, 1] = (ids[0, 1] + 1 + vocab // 2) % vocab if vocab > 2 else 1 - ids[0, 1]
    return ids, pos, perturbed, a


def _stand_in(
    report: ProbeReport, tracer: RunTracer, calls: list, metadata_key: str, marker, used_kwargs, ignored_kwargs
):
    """The attention the dry run registers: per-token (`inputs.per_token`); in runs A, B and C
    it appends its module to `calls` and notes on `report` what the call received."""

    def stand_in(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cls = type(module).__name__
        if tracer.run == "loss":  # the loss check below: nothing to record
            return per_token(query, key, value, scaling)
        calls.append(module)
        if kwargs.get(metadata_key) is not marker:
            report.no_metadata.add(cls)
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            report.non_causal.add(cls)  # only modules the text path calls (a vision tower's never are)
        if isinstance(attention_mask, torch.Tensor):
            report.tensor_masks.add(f"{cls} ({tuple(attention_mask.shape)})")
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if window is not None:
            report.windows_attention.add(int(window))
        for k, v in kwargs.items():
            if k in used_kwargs or k in ignored_kwargs or v is None or v is False:
                continue
            report.unknown_kwargs.setdefault(k, set()).add(cls)
        report.heads.setdefault((int(query.shape[1]), int(key.shape[1])), set()).add(cls)  # query/key: [B, H(_kv), S, D]
        problem = f"{cls}: value head dim {value.shape[-1]} > key head dim {key.shape[-1]} is not supported by the kernels"
        if value.shape[-1] > key.shape[-1] and problem not in report.problems:  # once, not per layer and run
            report.problems.append(problem)
        return per_token(query, key, value, scaling)

    return stand_in


def _run_forwards(
    hf, tracer: RunTracer, calls: list, report: ProbeReport, ids, pos, perturbed, a: int, kw: dict
) -> None:
    """The loss check's extra forward, then runs A (the probe), B (one token perturbed) and C
    (the suffix [a:S] alone), without gradients; run A counts the attention calls and checks
    that the loss reads `shift_labels`."""
    targets, other = shift_label_pair(hf, ids)
    with torch.no_grad():
        tracer.run = "loss"  # the one extra forward: the loss under the second shift_labels
        try:
            other_loss = hf(input_ids=ids, position_ids=pos, labels=ids, shift_labels=other, **kw).loss
            loss_kw = {"labels": ids, "shift_labels": targets}  # run A computes the first loss
        except TypeError as e:
            if "shift_labels" not in str(e):
                raise  # another failure of the dry run: refused below with its own cause
            report.problems.append(no_shift_labels(hf, e))
            other_loss, loss_kw = None, {}
        for run, (x, p) in {"A": (ids, pos), "B": (perturbed, pos), "C": (ids[:, a:], pos[:, a:])}.items():
            tracer.start(run)
            calls.clear()
            out = hf(input_ids=x, position_ids=p, **kw, **(loss_kw if run == "A" else {}))
            if run == "A":
                report.attention_calls = len(calls)
                report.called = list(calls)
                loss_problem = loss_ignores_shift_labels(hf, out.loss, other_loss) if loss_kw else None
                if loss_problem:
                    report.problems.append(loss_problem)


def _failure_problems(tracer: RunTracer, e: Exception) -> list[str]:
    """The refusal of a dry run that raised, blamed on the module it raised in."""
    where = tracer.where()
    problems = []
    indexers = sorted({type(m).__name__ for m in where.modules() if "indexer" in type(m).__name__.lower()})
    if indexers:  # a name only enriches the message: the failure itself is the refusal
        problems.append(
            f"{', '.join(indexers)} in {type(where).__name__} is a sparse-attention indexer: it selects a global "
            "top-k of keys per query from the attention mask, which cannot be made exact on local shards"
        )
    problems.append(
        f"the dry run with sequence-parallel attention failed in {type(where).__name__} "
        f"({tracer.names.get(id(where), '?')}) with {type(e).__name__}: {str(e)[:300]} -- under SP the attention mask is "
        "left to our attention (the documents live on other ranks), so a module that reads the mask or runs "
        "outside the attention interface cannot be exact"
    )
    return problems


def _read_masks(report: ProbeReport, mask_fns: list) -> None:
    """The windows and the unsupported pieces of every mask function the runs built."""
    bad: set = set()
    for f in mask_fns:
        if f is not None:
            windows: set = set()
            mask_pieces(f, windows, bad)
            report.windows_mask |= windows
            report.mask_windows.append(frozenset(windows))
    report.mask_parts = bad


def _probe_meta(hf, metadata_key: str, used_kwargs: frozenset, ignored_kwargs: frozenset, handled: frozenset) -> ProbeReport:
    """The dry run of a model whose weights are on the meta device (every rank but 0 of a
    broadcast-from-rank-0 load): the rule is about structure, not values, so it runs on a
    twin with one decoder layer per kind (as `verify()` builds it), materialised on CPU with
    seeded weights -- the same twin on every rank, so every rank reaches the same verdict.
    The attention calls of each kept layer count for every layer of its kind."""
    with torch.random.fork_rng(devices=[]):  # init_weights draws from the global RNG
        torch.manual_seed(0)
        twin = reduced_copy(hf)  # meta: nothing is allocated until to_empty
        twin.to_empty(device="cpu")
        twin.init_weights()  # parameters and the buffers (RoPE frequencies) that to_empty left empty
    report = probe_model(twin, metadata_key, used_kwargs, ignored_kwargs, handled)
    kept = {}  # kind -> attention calls inside the twin's layer of that kind
    inside = 0
    for layer in decoder_layers(twin):
        if isinstance(layer, SkippedLayer):
            continue
        members = {id(m) for m in layer.modules()}
        kept[layer_kind(layer)] = n = sum(id(m) in members for m in report.called)
        inside += n
    outside = len(report.called) - inside  # attention outside the decoder layers runs once
    report.attention_calls = outside + sum(kept.get(layer_kind(layer), 0) for layer in decoder_layers(hf))
    report.called = []
    return report
