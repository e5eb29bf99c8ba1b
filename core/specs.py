"""Architecture specs (specs/<family>.yaml) and the role table (specs/roles.yaml): loaded with
yaml's safe loader (libyaml's where installed), validated into frozen objects, refused with SpecError naming file and field.

A spec file holds:
    family        name of the spec (the file stem)
    serves        {architectures: [HF class names], model_types: [config.json model_type]}
    gguf_arch     llama.cpp's architecture name ("llama", "qwen3moe"); "{arch}" in keys is it
    config        value name -> {keys: [config.json keys, dotted for nested objects; first
                  present and not null wins], default: constant, or (a string) an expression
                  over the values defined above it}
                  a value with no key present and no default is MissingConfigKey
    layers        expression: the number of layers ({bid} runs over range(layers))
    layer         optional: per-layer value name -> expression over config values and bid
    checks        [{expr, error, message}]: config checks; a false expr raises errors.<error>
                  with message.format(**values)
    tp_checks     the same, evaluated with `tp` as well (plan time)
    metadata      GGUF key -> {value: expression, type: u32|i32|f32|bool|str, when?: expression (the
                  key is written only where it holds: the rope scaling keys)}: the same on every rank
    rank_metadata the same, expressions may use `tp` and `rank`: per-rank values
    tensors       [{hf, name, role, shape, cut, when?, experts?}]:
                    hf     HF name template; {bid} the layer, {xid} the expert
                    name   artifact base name template (llama.cpp's): "blk.{bid}.attn_q"
                    role   a role of specs/roles.yaml
                    shape  expressions: the logical shape ([out, in]; per expert for experts)
                    cut    column (out rows; a 1-D tensor's only axis: a bias) | row (in columns) |
                           replicated | segments (axis 0 in several segments, each cut by its
                           own unit: a tensor whose rows hold
                           several per-head fields one after another, e.g. Qwen3-Next's conv
                           weight [q channels | k channels | v channels]; plain formats only)
                    unit   expression: the cut's granularity in logical elements (e.g. one
                           KV head group); whole units are shared out as evenly as possible,
                           the first ranks taking one more when they do not divide. Without
                           it the axis must divide by tp into equal slices. With a segments
                           cut: a list, one unit per segment (or one for every segment)
                    segments  with cut segments: expressions, the lengths of the segments along
                           axis 0 (summing to shape[0]); a rank holds its share of each, in order
                    when   expression: the tensor exists (default: always)
                    required  false: the checkpoint may leave it out (kept when stored; GLM-4.5's
                           NextN embed_tokens / shared_head.head, which some releases drop)
                    experts expression: the expert count; the {xid} tensors of a layer are
                           stacked as [expert, out, in] (the role's kind must be `experts`)
                    shards expression: the shard count; the {sid} tensors are the torch.chunk
                           pieces of one table along axis 0 (how save_pretrained writes
                           qwen4_exp's n-gram tables) and are joined into one artifact tensor
                           of `shape`, values as stored (plain formats, replicated)
    constants     [{hf, value, when?}]: integer tensors whose values the config determines
                  (qwen4_exp's n-gram hash buffers): read and compared with `value` at
                  prepare (ConstantMismatch naming the tensor), not written to the artifact
    ignore        [{hf, when?}]: checkpoint tensors that are read by nothing ({any} in hf: any
                  name part, e.g. a vision tower's "model.visual.{any}")
    aliases       optional {stored prefix: hf prefix}, applied in order: a tensor whose name
                  starts with the first is read as if it started with the second ({bid} in
                  both: the layer). One checkpoint layout read as another: qwen4_exp's
                  model.language_model. for model., glm5_next's module names as ModelOpt
                  writes them (attn_hc.fn) for the names save_pretrained writes (hc_attn_fn)

A shared fragment: `"@include": NAME` as an entry of config or metadata, or `{"@include": NAME}`
as an item of checks or tensors, stands for that section of specs/include/NAME.yaml, spliced in
at that place (the order, and with it the artifact's bytes, as if its lines were written there; a
name given twice is a SpecError). specs/include/rope_scaling.yaml: the rope and its llama3 / YaRN
scaling, for llama, qwen2, qwen3 and qwen3_moe; attention_bias.yaml: the optional q/k/v/o biases
of llama, qwen3 and qwen3_moe.

Implicit values (set by the planner from the checkpoint, not config.json): kv_cache_quant,
true when the quantization config stores KV-cache scales (k_scale / v_scale); mtp, true when
the checkpoint stores tensors under `mtp.` (a multi-token-prediction layer, Qwen3-Next's).

Expressions are Python expression syntax restricted to names, numbers, strings, lists,
arithmetic, comparisons, `in`, and/or/not, `a if c else b`, indexing (`layer_types[bid]`) and
calls of `share(n, tp, rank)` (rank's count when n units are shared out over tp ranks, as a
`unit` cut does), `len(xs)`, `outside(xs, allowed)` (the items of xs not in allowed),
`index(xs, x)` (x's position in xs, -1 when absent), `first(x)` (a list's first item, else x), `chunks(n, parts)` (how many pieces
torch.chunk gives), `yarn_attention_factor(factor, attention_factor, mscale, mscale_all_dim)`
(core/rope.py) and `ngram(vocab, ngram_size, heads_per_ngram, base, seed, layer_index,
divisor)` (core/ngram.tables as a dict: multipliers, sizes, offsets, rows); every name must be
one the context defines (checked at load).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from . import errors, ngram, rope
from .errors import MissingConfigKey, SpecError

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
CUTS = ("column", "row", "replicated", "segments")
IMPLICIT = {"kv_cache_quant": False, "mtp": False}     # name -> value when not given
TYPES = {"u32": np.uint32, "i32": np.int32, "f32": np.float32, "bool": bool, "str": str}

# --- expressions -----------------------------------------------------------------------

_OPS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a / b, ast.Mod: lambda a, b: a % b,
    ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Not: lambda a: not a, ast.USub: lambda a: -a, ast.UAdd: lambda a: +a,
}
_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Name,
          ast.Load, ast.Constant, ast.List, ast.Tuple, ast.IfExp, ast.Call, ast.Subscript, *_OPS)


def share(n: int, tp: int, rank: int) -> int:
    """How many of n units rank holds when they are shared out over tp ranks (first ranks take the rest)."""
    return n // tp + (1 if rank < n % tp else 0)


def outside(xs, allowed) -> list:
    """The items of xs that are not in allowed, in order (a config check: `not outside(...)`)."""
    return [x for x in xs if x not in allowed]


def index(xs, x) -> int:
    """x's position in xs, -1 when absent."""
    return list(xs).index(x) if x in xs else -1


def _ngram(vocab, ngram_size, heads_per_ngram, base, seed, layer_index, divisor) -> dict:
    t = ngram.tables(int(vocab), int(ngram_size), int(heads_per_ngram), int(base), int(seed), int(layer_index),
                     int(divisor))
    return {"multipliers": list(t.multipliers), "sizes": list(t.sizes), "offsets": list(t.offsets), "rows": t.rows}


def _chunks(n, parts) -> int:
    return len(ngram.chunks(int(n), int(parts)))


def first(x):
    """x's first item when x is a list (config.json's eos_token_id may be one), else x."""
    return x[0] if isinstance(x, list) and x else x


FUNCS = {"share": share, "len": len, "outside": outside, "index": index, "ngram": _ngram, "chunks": _chunks,
         "first": first, "yarn_attention_factor": rope.yarn_attention_factor}


@dataclass(frozen=True)
class Expr:
    text: str
    tree: ast.Expression
    names: frozenset

    def __call__(self, env: dict) -> Any:
        try:
            return _eval(self.tree.body, env)
        except (TypeError, ValueError, ArithmeticError, IndexError, KeyError) as e:    # config.json's values
            used = {n: env[n] for n in sorted(self.names) if n in env and n not in IMPLICIT}
            raise errors.UnsupportedConfig(f"config.json: the spec's expression {self.text!r} cannot be evaluated on "
                                           f"{used} ({type(e).__name__}: {e}); a value of config.json has the wrong "
                                           f"type or range: fix it or re-export the checkpoint") from None

    def as_int(self, env: dict) -> int:
        """The value as an int (a count, a size), or UnsupportedConfig naming the expression."""
        v = self(env)
        try:
            return int(v)
        except (TypeError, ValueError, OverflowError):
            raise errors.UnsupportedConfig(f"config.json: the spec's expression {self.text!r} is {v!r}, not an "
                                           f"integer; a value of config.json has the wrong type: fix it or "
                                           f"re-export the checkpoint") from None


def _eval(n, env):
    if isinstance(n, ast.Constant):
        return n.value
    if isinstance(n, ast.Name):
        return env[n.id]
    if isinstance(n, (ast.List, ast.Tuple)):
        return [_eval(e, env) for e in n.elts]
    if isinstance(n, ast.BinOp):
        return _OPS[type(n.op)](_eval(n.left, env), _eval(n.right, env))
    if isinstance(n, ast.UnaryOp):
        return _OPS[type(n.op)](_eval(n.operand, env))
    if isinstance(n, ast.BoolOp):
        vals = (_eval(v, env) for v in n.values)
        return all(vals) if isinstance(n.op, ast.And) else any(vals)
    if isinstance(n, ast.IfExp):
        return _eval(n.body, env) if _eval(n.test, env) else _eval(n.orelse, env)
    if isinstance(n, ast.Call):
        return FUNCS[n.func.id](*(_eval(a, env) for a in n.args))
    if isinstance(n, ast.Subscript):
        return _eval(n.value, env)[_eval(n.slice, env)]
    if isinstance(n, ast.Compare):
        left = _eval(n.left, env)
        for op, c in zip(n.ops, n.comparators):
            right = _eval(c, env)
            if not _OPS[type(op)](left, right):
                return False
            left = right
        return True
    raise TypeError(type(n).__name__)


def expr(text, where: str, known) -> Expr:
    """Compile a spec expression; SpecError if it is not one or uses a name outside `known`."""
    if isinstance(text, bool) or isinstance(text, (int, float)):
        text = repr(text)
    if not isinstance(text, str):
        raise SpecError(f"{where}: expected an expression, found {text!r}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise SpecError(f"{where}: {text!r} is not an expression ({e.msg})") from None
    calls = set()
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            raise SpecError(f"{where}: {text!r} uses {type(node).__name__}, which spec expressions do not allow")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCS or node.keywords:
                raise SpecError(f"{where}: {text!r} calls something other than {', '.join(FUNCS)}(...)")
            calls.add(id(node.func))
    names = frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in calls)
    unknown = sorted(names - set(known))
    if unknown:
        raise SpecError(f"{where}: {text!r} names {', '.join(unknown)}, which is not defined here "
                        f"(known: {', '.join(sorted(known))})")
    return Expr(text, tree, names)


# --- the objects ------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    expr: Expr
    error: type
    message: str

    def run(self, env: dict, where: str) -> None:
        if not self.expr(env):
            raise self.error(f"{where}: {self.message.format(**env)}.")


@dataclass(frozen=True)
class Meta:
    expr: Expr
    type: str
    when: Expr | None = None

    def applies(self, env: dict) -> bool:
        return self.when is None or bool(self.when(env))

    def value(self, env: dict):
        v = self.expr(env)
        try:
            out = TYPES[self.type](v)
            if np.ndim(out) != 0:
                raise TypeError
            return out
        except (TypeError, ValueError, OverflowError):
            raise errors.UnsupportedConfig(f"config.json: {self.expr.text!r} = {v!r} is not a GGUF {self.type} value; "
                                           f"fix config.json or re-export the checkpoint") from None


@dataclass(frozen=True)
class TensorRule:
    hf: str                   # HF name template
    name: str                 # artifact name template
    role: str
    kind: str                 # the role's kind in roles.yaml
    shape: tuple              # of Expr
    cut: str
    when: Expr | None
    experts: Expr | None
    pattern: re.Pattern       # matches concrete HF names; groups bid, xid
    unit: Expr | None = None  # the cut's granularity (logical elements); None: equal slices
    segments: tuple | None = None   # cut segments: ((length Expr, unit Expr | None), ...) along axis 0
    required: bool = True     # False: the checkpoint may leave it out
    shards: Expr | None = None      # the {sid} pieces of one table, joined along axis 0

    @property
    def per_layer(self) -> bool:
        return "{bid}" in self.hf


@dataclass(frozen=True)
class IgnoreRule:
    hf: str
    when: Expr | None
    pattern: re.Pattern


@dataclass(frozen=True)
class ConstantRule:
    hf: str
    value: Expr
    when: Expr | None
    pattern: re.Pattern


@dataclass(frozen=True)
class Kind:
    name: str
    formats: tuple | None     # None: every stored format
    q8: bool
    stacked: bool
    note: str


@dataclass(frozen=True)
class Roles:
    kinds: dict
    roles: dict               # role -> Kind


@dataclass(frozen=True)
class Spec:
    family: str
    path: Path
    architectures: tuple
    model_types: tuple
    gguf_arch: str
    config: dict              # value name -> (keys, default: Expr | None)
    layers: Expr
    layer: dict               # per-layer value name -> Expr
    checks: tuple
    tp_checks: tuple
    metadata: dict            # key -> Meta
    rank_metadata: dict
    tensors: tuple            # of TensorRule
    ignore: tuple             # of IgnoreRule
    constants: tuple = ()     # of ConstantRule
    aliases: tuple = ()       # ((stored prefix regex, hf prefix template), ...)

    def canonical(self, name: str) -> str:
        """A stored tensor name as the spec's templates spell it (its aliases applied in order)."""
        for rx, hf in self.aliases:
            m = rx.match(name)
            if m:
                name = hf.replace("{bid}", m.groupdict().get("bid") or "") + name[m.end():]
        return name

    def values(self, config: dict, where: str = "config.json", implicit: dict | None = None) -> dict:
        """The spec's config values from a config.json dict (plus the implicit values), then its
        checks (named refusals)."""
        env: dict = {**IMPLICIT, **(implicit or {})}
        for name, (keys, default) in self.config.items():
            for key in keys:
                v = _lookup(config, key)
                if v is not None:
                    env[name] = v
                    break
            else:
                if default is None:
                    raise MissingConfigKey(f"{where}: no {' / '.join(keys)}; the {self.family} spec "
                                           f"({self.path.name}) needs it as {name}.")
                env[name] = default(env)
        for c in self.checks:
            c.run(env, where)
        return env

    def layer_values(self, env: dict, bid: int) -> dict:
        out = {**env, "bid": bid}
        for name, e in self.layer.items():
            out[name] = e(out)
        return out


def _lookup(config: dict, key: str):
    cur: Any = config
    for k in key.split("."):
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


# --- loading ----------------------------------------------------------------------------

_FIELDS = {"family", "serves", "gguf_arch", "config", "layers", "layer", "checks", "tp_checks",
           "metadata", "rank_metadata", "tensors", "ignore", "constants", "aliases"}
_REQUIRED = {"family", "serves", "gguf_arch", "config", "layers", "metadata", "tensors"}
_TENSOR_FIELDS = {"hf", "name", "role", "shape", "cut", "when", "experts", "unit", "segments", "required",
                  "shards"}


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)     # libyaml's: the same documents, ten times faster


def _read(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_LOADER)
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(f"{path}: cannot be read as YAML ({e}).") from None


def _need(obj, typ, where: str, what: str):
    if not isinstance(obj, typ):
        raise SpecError(f"{where}: {what} must be a {getattr(typ, '__name__', typ)}, found {obj!r}")
    return obj


def _fields(obj: dict, allowed: set, required: set, where: str) -> None:
    _need(obj, dict, where, "the entry")
    extra = sorted(set(obj) - allowed)
    if extra:
        raise SpecError(f"{where}: unknown field(s) {', '.join(map(str, extra))} (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(obj))
    if missing:
        raise SpecError(f"{where}: missing field(s) {', '.join(missing)}")


def _template_regex(t: str) -> re.Pattern:
    parts = re.split(r"(\{bid\}|\{xid\}|\{sid\}|\{any\})", t)
    rx = "".join({"{bid}": r"(?P<bid>\d+)", "{xid}": r"(?P<xid>\d+)", "{sid}": r"(?P<sid>\d+)",
                  "{any}": r".+"}.get(p, re.escape(p)) for p in parts)
    return re.compile(rx + r"\Z")


def _error_class(name, where: str) -> type:
    cls = getattr(errors, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.BloomeryError)):
        raise SpecError(f"{where}: error {name!r} is not a class of bloomery.core.errors")
    return cls


def _checks(rows, where: str, known) -> tuple:
    out = []
    for i, row in enumerate(_need(rows or [], list, where, "checks")):
        w = f"{where}[{i}]"
        _fields(row, {"expr", "error", "message"}, {"expr", "error", "message"}, w)
        e = expr(row["expr"], f"{w}.expr", known)
        msg = _need(row["message"], str, w, "message")
        try:
            msg.format(**{k: 0 for k in known})
        except (KeyError, IndexError, ValueError) as err:
            raise SpecError(f"{w}.message: {msg!r} does not format over the spec's values ({err!r})") from None
        out.append(Check(e, _error_class(row["error"], f"{w}.error"), msg))
    return tuple(out)


def _metadata(rows, where: str, known, arch: str) -> dict:
    out = {}
    for key, row in _need(rows or {}, dict, where, "metadata").items():
        w = f"{where}[{key!r}]"
        _fields(row, {"value", "type", "when"}, {"value", "type"}, w)
        if row["type"] not in TYPES:
            raise SpecError(f"{w}: type {row['type']!r} is not one of {', '.join(TYPES)}")
        when = expr(row["when"], f"{w}.when", known) if "when" in row else None
        out[str(key).replace("{arch}", arch)] = Meta(expr(row["value"], f"{w}.value", known), row["type"], when)
    return out


def _tensor(row, where: str, known, layer_known, roles: Roles) -> TensorRule:
    _fields(row, _TENSOR_FIELDS, {"hf", "name", "role", "shape", "cut"}, where)
    hf, name = _need(row["hf"], str, where, "hf"), _need(row["name"], str, where, "name")
    per_layer = "{bid}" in hf
    if per_layer != ("{bid}" in name):
        raise SpecError(f"{where}: {{bid}} must be in both hf ({hf!r}) and name ({name!r}) or in neither")
    if "{xid}" in name:
        raise SpecError(f"{where}: name {name!r} holds {{xid}}; experts are stacked into one artifact tensor")
    role = row["role"]
    if role not in roles.roles:
        raise SpecError(f"{where}: role {role!r} is not in roles.yaml")
    kind = roles.roles[role]
    if kind.stacked != ("experts" in row) or kind.stacked != ("{xid}" in hf):
        raise SpecError(f"{where}: role {role!r} (kind {kind.name}) {'needs' if kind.stacked else 'takes no'} "
                        f"`experts` and {{xid}} in hf ({hf!r})")
    k = layer_known if per_layer else known
    shape = tuple(expr(s, f"{where}.shape[{i}]", k) for i, s in enumerate(_need(row["shape"], list, where, "shape")))
    if row["cut"] not in CUTS:
        raise SpecError(f"{where}: cut {row['cut']!r} is not one of {', '.join(CUTS)}")
    if row["cut"] not in ("replicated", "segments", "column") and len(shape) < 2:   # column: a bias's rows
        raise SpecError(f"{where}: a {len(shape)}-D tensor can only be replicated or column-cut, not cut {row['cut']}")
    when = expr(row["when"], f"{where}.when", k) if "when" in row else None
    experts = expr(row["experts"], f"{where}.experts", k) if "experts" in row else None
    if ("segments" in row) != (row["cut"] == "segments"):
        raise SpecError(f"{where}: `segments` goes with cut segments (and cut segments needs it)")
    segments = None
    if row["cut"] == "segments":
        if kind.stacked:
            raise SpecError(f"{where}: stacked experts cannot be cut in segments")
        lengths = _need(row["segments"], list, where, "segments")
        units = row.get("unit")
        units = units if isinstance(units, list) else [units] * len(lengths)
        if not lengths or len(units) != len(lengths):
            raise SpecError(f"{where}: {len(lengths)} segments but {len(units)} units")
        segments = tuple((expr(n, f"{where}.segments[{i}]", k),
                          None if u is None else expr(u, f"{where}.unit[{i}]", k))
                         for i, (n, u) in enumerate(zip(lengths, units)))
    unit = expr(row["unit"], f"{where}.unit", k) if "unit" in row and segments is None else None
    if "unit" in row and row["cut"] == "replicated":
        raise SpecError(f"{where}: a replicated tensor takes no unit")
    required = row.get("required", True)
    if not isinstance(required, bool):
        raise SpecError(f"{where}: required must be true or false, found {required!r}")
    shards = expr(row["shards"], f"{where}.shards", k) if "shards" in row else None
    if (shards is not None) != ("{sid}" in hf) or "{sid}" in name:
        raise SpecError(f"{where}: `shards` goes with {{sid}} in hf ({hf!r}) and not in name ({name!r})")
    if shards is not None and (row["cut"] != "replicated" or kind.stacked):
        raise SpecError(f"{where}: a sharded table is joined whole: cut replicated, not {row['cut']}")
    return TensorRule(hf, name, role, kind.name, shape, row["cut"], when, experts, _template_regex(hf), unit,
                      segments, required, shards)


INCLUDE = "@include"          # a shared fragment (specs/include/<name>.yaml) spliced in where the key stands


def _splice(raw, where: str):
    """The spec with its includes spliced in: an `"@include": NAME` entry of config or metadata (or a
    `{"@include": NAME}` item of checks or tensors) stands for that section of specs/include/NAME.yaml,
    at that place, so that order (and with it the artifact's bytes) is as if the lines were written there."""
    if not isinstance(raw, dict):
        return raw
    frags: dict = {}

    def frag(name, at):
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name):
            raise SpecError(f"{where}: {at}: {INCLUDE} takes a fragment name, found {name!r}")
        if name not in frags:
            fp = SPECS_DIR / "include" / f"{name}.yaml"
            if not fp.is_file():
                raise SpecError(f"{where}: {at}: {INCLUDE} {name!r}: no fragment {fp.name} in specs/include/")
            frags[name] = _need(_read(fp), dict, str(fp), "a fragment")
        return frags[name]

    out = dict(raw)
    for sec in ("config", "metadata"):
        body = raw.get(sec)
        if isinstance(body, dict) and INCLUDE in body:
            merged: dict = {}
            for k, v in body.items():
                items = _need(frag(v, sec).get(sec) or {}, dict, where, f"{sec} of fragment {v!r}").items() \
                    if k == INCLUDE else [(k, v)]
                for kk, vv in items:
                    if kk in merged:                      # the spec's key before or after the fragment's
                        raise SpecError(f"{where}: {sec}.{kk} is given twice (the spec and a fragment)")
                    merged[kk] = vv
            out[sec] = merged
    for sec in ("checks", "tensors"):
        body = raw.get(sec)
        if isinstance(body, list):
            out[sec] = [c for item in body for c in (
                _need(frag(item[INCLUDE], sec).get(sec) or [], list, where, f"{sec} of a fragment")
                if isinstance(item, dict) and set(item) == {INCLUDE} else [item])]
    return out


def load(path) -> Spec:
    """One spec file, validated (SpecError naming the file and field otherwise)."""
    path = Path(path)
    w = str(path)
    raw = _splice(_read(path), w)
    _fields(raw, _FIELDS, _REQUIRED, w)
    roles = load_roles()
    serves = _need(raw["serves"], dict, w, "serves")
    _fields(serves, {"architectures", "model_types"}, {"architectures", "model_types"}, f"{w}: serves")
    arch = _need(raw["gguf_arch"], str, w, "gguf_arch")
    config: dict = {}
    for name, row in _need(raw["config"], dict, w, "config").items():
        cw = f"{w}: config.{name}"
        _fields(row, {"keys", "default"}, {"keys"}, cw)
        keys = tuple(str(k) for k in _need(row["keys"], list, cw, "keys"))
        default = None
        if "default" in row:
            d = row["default"]
            default = expr(d, f"{cw}.default", config) if isinstance(d, str) else expr(repr(d), f"{cw}.default", ())
        config[name] = (keys, default)
    known = set(config) | set(IMPLICIT)
    layer: dict = {}
    for name, text in _need(raw.get("layer") or {}, dict, w, "layer").items():
        layer[name] = expr(text, f"{w}: layer.{name}", known | {"bid"} | set(layer))
    layer_known = known | {"bid"} | set(layer)
    tensors = tuple(_tensor(r, f"{w}: tensors[{i}]", known, layer_known, roles)
                    for i, r in enumerate(_need(raw["tensors"], list, w, "tensors")))
    ignore = []
    for i, r in enumerate(_need(raw.get("ignore") or [], list, w, "ignore")):
        iw = f"{w}: ignore[{i}]"
        _fields(r, {"hf", "when"}, {"hf"}, iw)
        hf = _need(r["hf"], str, iw, "hf")
        k = layer_known if "{bid}" in hf else known
        ignore.append(IgnoreRule(hf, expr(r["when"], f"{iw}.when", k) if "when" in r else None, _template_regex(hf)))
    constants = []
    for i, r in enumerate(_need(raw.get("constants") or [], list, w, "constants")):
        cw = f"{w}: constants[{i}]"
        _fields(r, {"hf", "value", "when"}, {"hf", "value"}, cw)
        hf = _need(r["hf"], str, cw, "hf")
        k = layer_known if "{bid}" in hf else known
        constants.append(ConstantRule(hf, expr(r["value"], f"{cw}.value", k),
                                      expr(r["when"], f"{cw}.when", k) if "when" in r else None, _template_regex(hf)))
    aliases = []
    for a, b in _need(raw.get("aliases") or {}, dict, w, "aliases").items():
        if ("{bid}" in str(a)) != ("{bid}" in str(b)):
            raise SpecError(f"{w}: aliases: {{bid}} must be in both {a!r} and {b!r} or in neither")
        aliases.append((re.compile(_template_regex(str(a)).pattern[:-2]), str(b)))     # a prefix: no \Z
    aliases = tuple(aliases)
    return Spec(
        family=_need(raw["family"], str, w, "family"), path=path,
        architectures=tuple(serves["architectures"]), model_types=tuple(serves["model_types"]),
        gguf_arch=arch, config=config, layers=expr(raw["layers"], f"{w}: layers", known), layer=layer,
        checks=_checks(raw.get("checks"), f"{w}: checks", known),
        tp_checks=_checks(raw.get("tp_checks"), f"{w}: tp_checks", known | {"tp"}),
        metadata=_metadata(raw["metadata"], f"{w}: metadata", known, arch),
        rank_metadata=_metadata(raw.get("rank_metadata"), f"{w}: rank_metadata", known | {"tp", "rank"}, arch),
        tensors=tensors, ignore=tuple(ignore), constants=tuple(constants), aliases=aliases)


@lru_cache(maxsize=None)
def load_roles(path: Path = SPECS_DIR / "roles.yaml") -> Roles:
    """specs/roles.yaml: role -> kind, kind -> formats read, lever eligibility."""
    from .formats import FORMATS

    raw = _read(path)
    w = str(path)
    _fields(raw, {"kinds", "roles"}, {"kinds", "roles"}, w)
    kinds = {}
    for name, row in _need(raw["kinds"], dict, w, "kinds").items():
        kw = f"{w}: kinds.{name}"
        _fields(row, {"formats", "q8", "stacked", "note"}, {"formats", "q8"}, kw)
        fmts = row["formats"]
        if fmts != "any":
            bad = [f for f in _need(fmts, list, kw, "formats") if f not in FORMATS]
            if bad:
                raise SpecError(f"{kw}: unknown format(s) {', '.join(map(str, bad))} (known: {', '.join(FORMATS)})")
        kinds[name] = Kind(name, None if fmts == "any" else tuple(fmts), bool(row["q8"]),
                           bool(row.get("stacked", False)), str(row.get("note", "")))
    roles = {}
    for role, kind in _need(raw["roles"], dict, w, "roles").items():
        if kind not in kinds:
            raise SpecError(f"{w}: roles.{role}: kind {kind!r} is not in kinds")
        roles[role] = kinds[kind]
    return Roles(kinds, roles)


@lru_cache(maxsize=None)
def all_specs(folder: Path = SPECS_DIR) -> dict:
    """family -> Spec, for every architecture spec in specs/ (roles.yaml, levers.yaml and the
    other data files are not architecture specs)."""
    out = {}
    for p in sorted(folder.glob("*.yaml")):
        if p.stem in ("roles", "levers", "gates", "bands"):
            continue
        s = load(p)
        if s.family != p.stem:
            raise SpecError(f"{p}: family {s.family!r} differs from the file name")
        out[s.family] = s
    return out


def for_config(config: dict, where: str = "config.json") -> Spec:
    """The spec serving a config.json (its architectures, then its model_type), or UnknownArchitecture."""
    specs = all_specs()
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise errors.UnreadableJSON(f"{where}: \"architectures\" is {archs!r}; expected a list of class names "
                                    f"(\"LlamaForCausalLM\")")
    for s in specs.values():
        if any(a in s.architectures for a in archs):
            return s
    mt = config.get("model_type")
    for s in specs.values():
        if mt in s.model_types:
            return s
    served = "; ".join(f"{s.family}: {', '.join(s.architectures)}" for s in specs.values())
    raise errors.UnknownArchitecture(f"{where}: architectures {archs} / model_type {mt!r} is served by no spec "
                                     f"in {SPECS_DIR} ({served}).")


def gguf_value_type(v):
    """The GGUF value type of a metadata value as planning produces it (np.uint32, np.int32,
    np.float32, bool, str)."""
    from gguf import GGUFValueType

    for t, g in ((bool, GGUFValueType.BOOL), (np.uint32, GGUFValueType.UINT32), (np.int32, GGUFValueType.INT32),
                 (np.float32, GGUFValueType.FLOAT32), (str, GGUFValueType.STRING)):
        if isinstance(v, t):
            return g
    raise TypeError(f"metadata value {v!r} of type {type(v).__name__}")
