"""The float32 oracle (tools/oracle.py) of the flagship families, qwen4_exp and glm5_next, on their
tiny test models (make models): loaded by transformers' own conversion of the stored names, every
parameter exactly the stored value, causal at 512 and 1,024 positions (no indexer tie flips a
selection), and the indexer / router margins that tell ties apart."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bloomery.tools import models, oracle  # noqa: E402

pytestmark = pytest.mark.models

FAMILIES = ("qwen4_exp", "glm5_next")
FORMATS = ("bf16", "nvfp4")
TIE_MARGIN = 5e-5           # tools/gates.py's
# the first position whose indexer keeps fewer than it sees: 4 blocks (QSA) / pools (DSA) of 4 kept,
# a cut from 5 complete ones on, i.e. position 19
FIRST_CUT = 19


def need(name):
    if not models.is_built(name):
        pytest.skip(f"{name} is not built (make models)")
    return models.model_dir(name)


def prompt(n: int = 1024) -> list[int]:
    """Seeded ids of the tiny vocabulary with EOS (2) inside: the PLE n-gram context restarts there."""
    g = np.random.default_rng(11)
    ids = g.integers(3, 512, n)
    ids[g.choice(n, 12, replace=False)] = 2
    return ids.tolist()


@pytest.fixture(scope="module")
def oracles(tmp_path_factory):
    """One oracle per folder for the module, with a private disk cache (logits computed once)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(oracle.CACHE_ENV, str(tmp_path_factory.mktemp("oracle-cache")))
    made: dict[str, oracle.Oracle] = {}

    def get(name):
        if name not in made:
            made[name] = oracle.Oracle(need(name))
        return made[name]
    yield get
    mp.undo()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_causal_at_512_and_1024_positions(fam, fmt, oracles):
    """Teacher-forced logits of the first 512 ids equal the first 512 rows of the 1,024-id forward.
    A top-k tie at an indexer's cut breaks by the candidates' count (docs/flagships.md Surprise 6)
    and shows here as rows that differ by far more than rounding."""
    o = oracles(f"tiny-{fam}/{fmt}")
    ids = prompt()
    full = o.logits(ids)
    assert full.shape == (1024, 512) and full.dtype == np.float32 and np.isfinite(full).all()
    assert full.std() > 0 and len(set(full.argmax(-1).tolist())) > 50      # a model, not a constant
    half = o.logits(ids[:512])
    scale = np.abs(full).max()
    assert np.abs(half - full[:512]).max() <= 1e-6 * scale, np.abs(half - full[:512]).max() / scale
    assert (half.argmax(-1) == full[:512].argmax(-1)).all()


def _stored(folder):
    """The folder's tensors under their stored names, decoded by tools/dequant.py (not the oracle)."""
    from bloomery.tools import dequant

    return dequant.folder_weights(folder)


def _get(w, *names):
    """The first of `names` that is stored (ModelOpt's glm5_next exports keep the module names)."""
    for n in names:
        if n in w:
            return w[n]
    raise KeyError(names)


@pytest.mark.parametrize("fmt", FORMATS)
def test_qwen4_parameters_are_the_stored_tensors(fmt):
    """Beyond load_stored's key check (every parameter filled, every tensor used): the converted
    tensors hold the stored values, read here without transformers: the PLE table is its shards
    one after the other, the fused experts are the per-expert gate then up rows."""
    folder = need(f"tiny-qwen4_exp/{fmt}")
    m = oracle.build_model(folder)
    w = _stored(folder)
    sd = m.state_dict()
    p = "model.layers.2.ple.ple_embedding."
    shards = sorted((k for k in w if k.startswith(p + "ngram_embedding.shard_")),
                    key=lambda k: int(k.split("shard_")[1].split(".")[0]))
    assert len(shards) == m.config.split_ngram_parts
    assert torch.equal(sd[p + "ngram_embedding.weight"], torch.cat([w[k] for k in shards]))
    for b in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        assert sd[p + b].dtype == torch.int64 and torch.equal(sd[p + b], w[p + b])
    e = "model.layers.3.mlp.experts."
    for i in (0, 5):
        assert torch.equal(sd[e + "gate_up_proj"][i], torch.cat([w[f"{e}{i}.gate_proj.weight"],
                                                                 w[f"{e}{i}.up_proj.weight"]]))
        assert torch.equal(sd[e + "down_proj"][i], w[f"{e}{i}.down_proj.weight"])
    for k in ("model.layers.0.ple.conv1d.weight", "model.hyper_connection_mixer.hc_norm.weight",
              "model.layers.3.self_attn.indexer.index_qk_proj.weight", "lm_head.weight"):
        assert torch.equal(sd[k], w[k]), k
    assert {str(t.dtype) for t in sd.values()} == {"torch.float32", "torch.int64"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_glm5_parameters_are_the_stored_tensors(fmt):
    """glm5_next: the hub names (bf16: hc_attn_fn, q/k/v_conv1d, self_attn.A_log) and ModelOpt's
    module names (attn_hc.fn, conv1d, forget_gate.A_log) load into the same parameters, with the
    stored values; the language model's parameters are all float32."""
    folder = need(f"tiny-glm5_next/{fmt}")
    m = oracle.build_model(folder)
    w = _stored(folder)
    sd = m.state_dict()
    L = "model.language_model.layers."
    conv = sd[L + "4.self_attn.conv1d.weight"]
    if f"{L}4.self_attn.q_conv1d.weight" in w:
        assert fmt == "bf16"
        want = torch.cat([w[f"{L}4.self_attn.{x}_conv1d.weight"] for x in "qkv"])
    else:
        want = w[L + "4.self_attn.conv1d.weight"]
    assert torch.equal(conv, want)
    for mod, hub in (("attn_hc.fn", "hc_attn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("attn_hc.scale", "hc_attn_scale")):
        assert torch.equal(sd[f"{L}7.{mod}"], _get(w, f"{L}7.{hub}", f"{L}7.{mod}")), mod
    for x in ("A_log", "dt_bias", "f_a_proj.weight"):
        assert torch.equal(sd[f"{L}1.self_attn.forget_gate.{x}"],
                          _get(w, f"{L}1.self_attn.{x}", f"{L}1.self_attn.forget_gate.{x}")), x
    e = L + "6.mlp.experts."
    assert torch.equal(sd[e + "gate_up_proj"][3], torch.cat([w[f"{e}3.gate_proj.weight"], w[f"{e}3.up_proj.weight"]]))
    ix = L + "3.self_attn.indexer."
    for k in ("index_kpool_compress_gate", "index_kpool_compress_ape", "k_norm.bias"):
        assert torch.equal(sd[ix + k], w[ix + k]), k
    assert all(p.dtype == torch.float32 for p in m.model.language_model.parameters())


PLANTED = {   # family -> a stored tensor, renamed by the defect below
    "qwen4_exp": "model.layers.0.ple.key_proj.weight",
    "glm5_next": "model.language_model.layers.1.hc_attn_fn",
}


@pytest.mark.parametrize("fam", FAMILIES)
def test_the_loaded_parameter_set_is_exactly_the_models(fam):
    """A renamed, a missing, a stray or a mis-shaped tensor is an error naming it."""
    folder = need(f"tiny-{fam}/bf16")
    w = oracle.checkpoint_weights(folder)
    key = PLANTED[fam]
    renamed = dict(w)
    renamed[key.replace(".weight", "_x.weight") if key.endswith(".weight") else key + "_x"] = renamed.pop(key)
    # the model misses `key` (or, for a fused conversion target, its part) and has no place for the new name
    with pytest.raises(oracle.OracleError, match=r"no stored tensor.*; stored tensors the model has no place for"):
        oracle.build_model(folder, renamed)
    missing = {k: v for k, v in w.items() if k != "lm_head.weight"}
    with pytest.raises(oracle.OracleError, match="no stored tensor: lm_head.weight"):
        oracle.build_model(folder, missing)
    extra = dict(w, **{"model.extra_norm.weight": np.ones(128, np.float32)})
    with pytest.raises(oracle.OracleError, match="no place for: model.extra_norm.weight"):
        oracle.build_model(folder, extra)
    wrong = dict(w, **{"lm_head.weight": np.ones((512, 7), np.float32)})
    with pytest.raises(oracle.OracleError, match="lm_head.weight"):
        oracle.build_model(folder, wrong)
    if fam == "qwen4_exp":     # a PLE shard missing: the table is short (transformers' shard glob
        # matches any `shard_*`, so a renamed shard would still be concatenated, in natural order)
        short = {k: v for k, v in w.items() if not k.endswith("ngram_embedding.shard_3.weight")}
        with pytest.raises(oracle.OracleError, match="ngram_embedding"):
            oracle.build_model(folder, short)


@pytest.mark.parametrize("fam", FAMILIES)
def test_indexer_margins(fam, oracles):
    """+inf where an indexer keeps every block / pool it sees (before FIRST_CUT), finite from then on,
    one per position; the same numbers on a prefix (they are causal too) to float32 rounding: torch's CPU
    matmuls block a 512-row product differently from a 1,024-row one, which moves these relative margins
    (~1e-2) by ~1e-6; a position that saw a later token would move them by their own size."""
    o = oracles(f"tiny-{fam}/bf16")
    ids = prompt()
    m = o.indexer_margins(ids)
    assert m.shape == (1024,)
    assert np.isinf(m[:FIRST_CUT]).all() and np.isfinite(m[FIRST_CUT:]).all() and (m[FIRST_CUT:] >= 0).all()
    np.testing.assert_allclose(o.indexer_margins(ids[:512]), m[:512], rtol=0, atol=1e-5)


def test_no_indexer_no_margins():
    o = oracle.Oracle(need("tiny-qwen3_next/bf16"), cache=False)
    assert o.indexer_margins([5, 6, 7, 8]) is None


def _zero(folder, pattern, rows=None):
    """The folder's weights with the tensors whose name contains `pattern` set to zero (rows: only those)."""
    w = oracle.checkpoint_weights(folder)
    hit = [k for k in w if pattern in k]
    assert hit, pattern
    for k in hit:
        w[k] = w[k].copy()
        if rows is None:
            w[k][...] = 0
        else:
            w[k][:rows] = 0
    return w


@pytest.mark.parametrize("fam", FAMILIES)
def test_a_planted_indexer_tie_is_measured(fam):
    """The indexers' queries zeroed: every candidate scores 0, a tie at every cut (margin 0)."""
    folder = need(f"tiny-{fam}/bf16")
    if fam == "qwen4_exp":     # index_qk_proj rows: 8 query heads x 32, then the key head
        w = _zero(folder, "indexer.index_qk_proj.weight", rows=8 * 32)
    else:
        w = _zero(folder, "indexer.wq_b.weight")
    o = oracle.Oracle(folder, weights=lambda: w, weights_key="planted-tie", cache=False)
    m = o.indexer_margins(prompt(64))
    assert np.isinf(m[:FIRST_CUT]).all() and (m[FIRST_CUT:] == 0).all()


def test_router_margins_with_the_group_limit():
    """GLM-5's router (n_group 2, topk_group 1): zero router weights and correction bias make every
    expert and group score 0.5, a tie (margin 0) at every position; the real router is finite."""
    folder = need("tiny-glm5_next/bf16")
    o = oracle.Oracle(folder, cache=False)
    ids = prompt(64)
    real = o.router_margins(ids)
    assert real.shape == (64,) and np.isfinite(real).all() and (real > 0).all()
    w = _zero(folder, "mlp.gate.")
    flat = oracle.Oracle(folder, weights=lambda: w, weights_key="flat-router", cache=False).router_margins(ids)
    assert (flat == 0).all()


def test_cut_margins():
    """(s_k - s_(k+1)) / max|s| over the valid entries of a row; +inf with k or fewer valid ones."""
    lo = -3.4e38                               # DSA's unselectable pools (float32's lowest)
    s = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 2.0, 2.0, -8.0], [1.0, 5.0, lo, lo], [1.0, 5.0, 3.0, lo],
                      [1.0, 5.0, 9.0, 2.0]])
    valid = s > -3e38
    valid[4, 2] = False                        # an invalid entry that would be the top
    got = oracle._cut_margins(s, 2, valid)
    np.testing.assert_allclose(got[[0, 1, 3, 4]], [1 / 4, 0.0, 2 / 5, 1 / 5])
    assert np.isinf(got[2])                    # two valid entries, two kept: no cut
    np.testing.assert_allclose(oracle._cut_margins(s[:1], 1), [1 / 4])


@pytest.mark.parametrize("fam", FAMILIES)
def test_ties_at_1024_positions(fam, oracles):
    """How many positions of the 1,024-id prompt have a router or indexer margin below TIE_MARGIN
    (printed; tools/gates.py may leave out at most 0.5% of a prompt set's positions): few."""
    o = oracles(f"tiny-{fam}/bf16")
    ids = prompt()
    r, i, t = o.router_margins(ids), o.indexer_margins(ids), o.tie_margins(ids)
    np.testing.assert_array_equal(t, np.minimum(r, i))
    counts = {k: int((v < TIE_MARGIN).sum()) for k, v in (("router", r), ("indexer", i), ("either", t))}
    print(f"tiny-{fam}/bf16, 1,024 positions, margin < {TIE_MARGIN:g}: {counts}")
    assert counts["either"] <= 10, counts


def test_router_margins_values_with_the_group_limit():
    """A router of 8 experts in 2 groups, top-2 of the top-1 group, on hand-set sigmoid scores:
    row 0, the groups tie (1.7 each): 0; row 1, group A is chosen by (1.7 - 1.15) / 1.7, and inside
    it the 2nd and 3rd experts are 0.8 and 0.3 apart by 0.5 / 0.9: the smaller, 0.3235 (without the
    group limit it would be (0.9 - 0.8) / 0.95)."""
    from types import SimpleNamespace

    scores = torch.tensor([[0.9, 0.8, 0.1, 0.1, 0.85, 0.85, 0.0, 0.0],
                           [0.9, 0.8, 0.3, 0.3, 0.95, 0.2, 0.1, 0.1]], dtype=torch.float64).clamp(1e-6, 1 - 1e-6)

    class TopkRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.logit(scores).T.float())     # [E, hidden]: x one-hot
            self.e_score_correction_bias = torch.zeros(8)
            self.top_k, self.num_group, self.topk_group = 2, 2, 1

        def forward(self, x):
            return x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = TopkRouter()
            self.config = SimpleNamespace(num_experts_per_tok=2)

        def forward(self, input_ids, use_cache=False):
            x = torch.nn.functional.one_hot(input_ids, 2).float()
            return SimpleNamespace(logits=self.gate(x))

    worst = np.full(2, np.inf)
    assert oracle._router_margins(Model(), [0, 1], worst)
    np.testing.assert_allclose(worst, [0.0, min(0.55 / 1.7, 0.5 / 0.9)], atol=1e-6)
