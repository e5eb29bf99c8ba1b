"""Checkpoint tensors against a spec's templates: every HF tensor matched by exactly one
template (or an ignore rule), every expected tensor present; experts grouped per layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bloomery.core.errors import ConstantMismatch, MissingTensor, SpecError, UnknownTensor, UnsupportedDtype
from bloomery.core.specs import Spec, TensorRule


@dataclass
class Slot:
    """One artifact tensor before planning: its rule, layer, name and HF tensors (by xid for experts)."""

    rule: TensorRule
    bid: int | None
    name: str
    hf: tuple          # HF names, one per expert when stacked (per shard when joined)
    env: dict          # the values its expressions see (config, layer values, bid)


def _expected(spec: Spec, values: dict) -> tuple[list[Slot], dict]:
    """The artifact tensors the spec expects, in spec order (globals first, then layers, then the
    rest), and HF name -> slot."""
    nlayers = spec.layers.as_int(values)
    envs = [spec.layer_values(values, b) for b in range(nlayers)]
    first_layer = next((i for i, r in enumerate(spec.tensors) if r.per_layer), len(spec.tensors))
    order = []
    for i, r in enumerate(spec.tensors):
        if r.per_layer:
            order += [(1, b, i) for b in range(nlayers)]
        else:
            order.append((0 if i < first_layer else 2, -1, i))
    slots, by_hf = [], {}
    for _, b, i in sorted(order):
        r = spec.tensors[i]
        env = envs[b] if r.per_layer else values
        if r.when is not None and not r.when(env):
            continue
        xids = range(r.experts.as_int(env)) if r.experts is not None else [None]
        sids = range(r.shards.as_int(env)) if r.shards is not None else [None]
        hf = tuple(r.hf.replace("{bid}", str(b)).replace("{xid}", str(x)).replace("{sid}", str(i))
                   for x in xids for i in sids)
        slot = Slot(r, b if r.per_layer else None, r.name.replace("{bid}", str(b)), hf, env)
        for h in hf:
            if h in by_hf:
                raise SpecError(f"{spec.path}: HF tensor {h!r} is expected by two templates "
                                f"({by_hf[h].rule.hf!r} and {r.hf!r})")
            by_hf[h] = slot
        slots.append(slot)
    return slots, by_hf


def _ignored(spec: Spec, values: dict, name: str) -> bool:
    for ig in spec.ignore:
        m = ig.pattern.match(name)
        if not m:
            continue
        env = values
        if m.groupdict().get("bid") is not None:
            env = spec.layer_values(values, int(m["bid"]))
        if ig.when is None or ig.when(env):
            return True
    return False


def _why_unknown(spec: Spec, values: dict, name: str) -> str:
    """Why a name that some template matches is still not expected."""
    nlayers = spec.layers.as_int(values)
    hits = [(r, m) for r in spec.tensors if (m := r.pattern.match(name))]
    if not hits:
        return "it matches no template of the spec"
    r, m = hits[0]
    g = m.groupdict()
    if g.get("bid") is not None and int(g["bid"]) >= nlayers:
        return f"layer {g['bid']} is beyond the {nlayers} layers of config.json"
    env = spec.layer_values(values, int(g["bid"])) if g.get("bid") is not None else values
    if r.when is not None and not r.when(env):
        return f"template {r.hf!r} applies only when {r.when.text}, which is false here"
    if g.get("xid") is not None:
        return f"expert {g['xid']} is beyond the {r.experts.as_int(env)} experts of config.json"
    if g.get("sid") is not None:
        return f"shard {g['sid']} is beyond the {r.shards.as_int(env)} shards the table is written in"
    return f"template {r.hf!r} does not expect it"   # not reached for a well-formed spec


def check_constants(spec: Spec, values: dict, ints: dict, where: str) -> None:
    """Every integer tensor (name as the spec spells it -> StoredTensor) is a constant of the spec
    holding exactly the values its rule computes, or ignored; ConstantMismatch / UnknownTensor."""
    for n, t in sorted(ints.items()):
        for c in spec.constants:
            m = c.pattern.match(n)
            if not m:
                continue
            env = values if m.groupdict().get("bid") is None else spec.layer_values(values, int(m["bid"]))
            if c.when is not None and not c.when(env):
                continue
            want = np.asarray(c.value(env), dtype=np.int64).reshape(-1)
            got = np.asarray(t.array()).astype(np.int64).reshape(-1)
            if got.shape != want.shape or not np.array_equal(got, want):
                raise ConstantMismatch(f"{t.shard.path}: tensor {t.name!r} ({t.dtype} {list(t.shape)}) holds "
                                       f"{got.tolist()[:8]}{' ...' if got.size > 8 else ''}; the {spec.family} "
                                       f"spec computes {want.tolist()[:8]}{' ...' if want.size > 8 else ''} = "
                                       f"{c.value.text} from config.json. The config and the weights disagree; "
                                       f"nothing was written.")
            break
        else:
            if not _ignored(spec, values, n):
                raise UnknownTensor(f"{where}: tensor {t.name!r} is stored as {t.dtype} {list(t.shape)}, an integer "
                                    f"tensor the {spec.family} spec ({spec.path.name}) does not read. Nothing was "
                                    f"written.")


def check_unread(spec: Spec, values: dict, tensors: dict) -> None:
    """Every tensor of a dtype no format reads (name as the spec spells it -> StoredTensor) is one
    the spec ignores, or UnsupportedDtype by name."""
    for n, t in sorted(tensors.items()):
        if not _ignored(spec, values, n):
            raise UnsupportedDtype(f"{t.shard.path}: tensor {t.name!r} is stored as {t.dtype} {list(t.shape)}, a "
                                   f"dtype no format of bloomery reads (a weight is BF16, F16, F32 or a quantized "
                                   f"format with its scales), and the {spec.family} spec ({spec.path.name}) does not "
                                   f"ignore it. Convert it or drop it. Nothing was written.")


def match(spec: Spec, values: dict, names, where: str) -> list[Slot]:
    """The spec's artifact tensors for a checkpoint holding HF tensors `names` (UnknownTensor /
    MissingTensor by name otherwise)."""
    present = set(names)
    nlayers = spec.layers.as_int(values)
    if nlayers > len(present):         # every layer holds a tensor: refused before a list of that many is made
        raise MissingTensor(f"{where}: config.json gives {nlayers} layers ({spec.layers.text}); the checkpoint "
                            f"stores {len(present)} tensors in all, so most layers are missing. Nothing was written.")
    slots, by_hf = _expected(spec, values)
    slots = [s for s in slots if s.rule.required or any(h in present for h in s.hf)]   # `required: false`, absent
    for n in sorted(present):
        if n in by_hf:
            continue
        if _ignored(spec, values, n):
            continue
        raise UnknownTensor(f"{where}: tensor {n!r} is not part of the {spec.family} spec ({spec.path.name}): "
                            f"{_why_unknown(spec, values, n)}. Nothing was written.")
    missing = [(h, s) for s in slots for h in s.hf if h not in present]
    if missing:
        h, s = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingTensor(f"{where}: tensor {h!r} (artifact tensor {s.name!r}, role {s.rule.role}) is expected by "
                            f"the {spec.family} spec but not stored{more}. Nothing was written.")
    return slots
