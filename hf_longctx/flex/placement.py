"""Steps 2-3 of the flexible planner for one choice of widths: documents into SP groups, groups into micro-batch slots.

Where it sits: `plan_flexible` (`flex/packing.py`) calls `construct` once per target slot
length τ, after `prepare` has checked the documents and built the cost tables, and keeps
the cheapest result (docs/DESIGN.md "Planning a step"; FlexSP §4, Hydraulis §4-5).
Pure NumPy, deterministic: the same groups on every rank from the same inputs.
Guarantees: every document in one group with room for it; every slot's ranks covered
exactly once (free ranks become groups of the smallest size)."""

from __future__ import annotations

import math

import numpy as np


def construct(width, order, padded, caps, costs, rho, sizes, world, num_slots, ovh):
    """Steps 2-3 of docs/DESIGN.md "Planning a step" for one choice of widths (shape index per doc).

    Groups are parallel arrays; a group's projected cost is its load plus its free room
    filled at the cheapest per-token cost of its shape (groups nearly always end full).
    `ovh[k]`: the per-micro-batch constant of shape k, a group's load from the start.
    Returns the groups' shape indices [G], slots [G], loads [G] and documents."""
    wide = [d for d in order if width[d] > 0]
    narrow = [d for d in order if width[d] == 0]
    groups, slot_max = _place_wide(wide, width, padded, caps, costs, rho, sizes, world, num_slots, ovh)
    return _place_narrow(narrow, groups, slot_max, padded, caps, costs, rho, sizes, world, ovh)


def _place_wide(wide, width, padded, caps, costs, rho, sizes, world, num_slots, ovh):
    """Step 2, then the free ranks: each wide document, costliest first, joins a group of its
    width or wider that has room, or opens one of its width, where its slot's projected maximum
    stays lowest (a new slot when no slot has the ranks free); then every slot's free ranks
    become groups of the smallest size. Returns the groups as parallel lists (shape index, slot, load,
    padded tokens, documents) and each slot's projected maximum."""
    g_shape, g_slot, g_load, g_tok, g_docs = [], [], [], [], []
    free = [world] * num_slots
    slot_max = [float(rho[0] * caps[0] + ovh[0])] * num_slots  # a slot of empty smallest groups, projected full

    def add_slot():
        free.append(world)
        slot_max.append(float(rho[0] * caps[0] + ovh[0]))

    def proj(k, load, tok):
        # Only groups of the smallest size are memory-bound fillers that end full; a wider
        # group holds what its documents cost -- filling its room with short documents that
        # pay its communication is a choice step 3 makes, not a given.
        return load + rho[k] * (caps[k] - tok) if k == 0 else load

    def open_group(k, m):
        free[m] -= sizes[k]
        g_shape.append(k), g_slot.append(m), g_load.append(float(ovh[k])), g_tok.append(0), g_docs.append([])
        return len(g_shape) - 1

    def put(d, g):
        k = g_shape[g]
        g_load[g] += costs[k, d]
        g_tok[g] += padded[k, d]
        g_docs[g].append(d)
        m = g_slot[g]
        slot_max[m] = max(slot_max[m], proj(k, g_load[g], g_tok[g]))

    for d in wide:  # step 2
        w = width[d]
        best, choice = -math.inf, None
        for g in range(len(g_shape)):
            k = g_shape[g]
            if k >= w and g_tok[g] + padded[k, d] <= caps[k]:
                key = slot_max[g_slot[g]] - proj(k, g_load[g] + costs[k, d], g_tok[g] + padded[k, d])
                if key > best:
                    best, choice = key, ("join", g)
        new = proj(w, ovh[w] + costs[w, d], padded[w, d])
        for m in range(len(free)):
            if free[m] >= sizes[w]:
                key = slot_max[m] - new
                if key > best:
                    best, choice = key, ("open", m)
        if choice is None:
            add_slot()
            choice = ("open", len(free) - 1)
        put(d, choice[1] if choice[0] == "join" else open_group(w, choice[1]))
    for m in range(len(free)):  # step 3: free ranks become groups of the smallest size
        while free[m]:
            open_group(0, m)
    return (g_shape, g_slot, g_load, g_tok, g_docs), slot_max


def _place_narrow(narrow, groups, slot_max, padded, caps, costs, rho, sizes, world, ovh):
    """Step 3, the rest of the documents: each, costliest first, goes to the group with room
    that stays furthest below its slot's projected maximum (a wider group only while it stays
    below it), a new slot of smallest groups when no group has room. `groups`, `slot_max`:
    `_place_wide`'s. Returns the groups' shape indices [G], slots [G], loads [G] and documents."""
    g_shape, g_slot, g_load, g_tok, g_docs = groups
    gs = np.array(g_shape, dtype=np.int64)
    gm = np.array(g_slot, dtype=np.int64)
    load = np.array(g_load, dtype=np.float64)
    tok = np.array(g_tok, dtype=np.int64)
    cap_g, rho_g = caps[gs], np.where(gs == 0, rho[gs], 0.0)
    smax = np.array(slot_max, dtype=np.float64)
    # Short documents come in batches: once a document costs < 1 % of a full smallest
    # group, the next B go to the B groups the rule ranks highest (one each, in rank order)
    # -- what the one-by-one rule does when each document barely moves its group's key --
    # so planning stays in milliseconds for thousands of short documents.
    small = 0.01 * rho[0] * caps[0]
    costs_t, padded_t = np.ascontiguousarray(costs.T), np.ascontiguousarray(padded.T)  # [N, K]: one row per document
    wide_g = gs > 0  # [G] groups wider than the smallest size
    i = 0
    while i < len(narrow):
        d = narrow[i]
        c, after = costs_t[d][gs], tok + padded_t[d][gs]  # [G]: this document's cost, tokens after adding it
        room = after <= cap_g
        new = load + c + rho_g * (cap_g - after)  # [G] projected cost after adding d
        over = smax[gm] - new  # [G] how far below its slot's maximum the group would stay
        # A wider group takes a short document only under its slot's maximum: its room is
        # not projected full, so letting it grow would lengthen the slot for short
        # documents that run cheaper (no communication) on the smallest groups.
        key = np.where(room & ~(wide_g & (over < 0)), over, -np.inf)
        g = int(np.argmax(key))
        if key[g] == -np.inf:
            key = np.where(room, over, -np.inf)
            g = int(np.argmax(key))
        if key[g] == -np.inf:  # no group has room: a new slot of smallest groups
            gs, gm, load, tok, smax = _open_smallest_slot(gs, gm, load, tok, smax, g_docs, caps, rho, sizes, world, ovh)
            cap_g, rho_g = caps[gs], np.where(gs == 0, rho[gs], 0.0)
            wide_g = gs > 0
            continue
        if costs_t[d, 0] >= small:  # one document: scalar updates (most of the planner's time)
            k = int(gs[g])
            load[g] += costs_t[d, k]
            tok[g] += padded_t[d, k]
            g_docs[g].append(d)
            m = int(gm[g])
            smax[m] = max(smax[m], load[g] + rho_g[g] * (cap_g[g] - tok[g]))
            i += 1
            continue
        b = min(max(1, len(key) // 4), len(narrow) - i, int(np.isfinite(key).sum()))
        top = np.argsort(-key, kind="stable")[:b]  # later documents are no longer: they fit too
        batch = np.array(narrow[i : i + len(top)])
        cg, pg = costs[gs[top], batch], padded[gs[top], batch]  # [b]
        load[top] += cg
        tok[top] += pg
        for g, dd in zip(top.tolist(), batch.tolist()):
            g_docs[g].append(dd)
        np.maximum.at(smax, gm[top], load[top] + rho_g[top] * (cap_g[top] - tok[top]))
        i += len(top)
    return gs, gm, load, g_docs


def _open_smallest_slot(gs, gm, load, tok, smax, g_docs, caps, rho, sizes, world, ovh):
    """One more slot of world / sizes[0] empty groups of the smallest size: the group arrays
    [G] grown by them (`g_docs` in place), the slot's projected maximum that of a full one."""
    m = len(smax)
    n_new = world // sizes[0]
    gs = np.concatenate([gs, np.zeros(n_new, dtype=np.int64)])
    gm = np.concatenate([gm, np.full(n_new, m)])
    load, tok = np.concatenate([load, np.full(n_new, ovh[0])]), np.concatenate([tok, np.zeros(n_new, dtype=np.int64)])
    g_docs += [[] for _ in range(n_new)]
    return gs, gm, load, tok, np.append(smax, rho[0] * caps[0] + ovh[0])
