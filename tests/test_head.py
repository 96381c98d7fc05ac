"""Feature heads (EAGLE-3): the target's features reach the head with no extra forward, the
head's tree forward is its math, its checkpoints are EAGLE-3's, and drafting with it is
lossless (enumeration on table models, chi-square and greedy parity on tiny Llamas)."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from treespec import SamplingConfig, SpeculativeDecoder, TokenTree, TreeConfig
from treespec.backends.base import extend_many
from treespec.backends.head import (
    ARCHITECTURE,
    HeadRunner,
    load_head,
    save_head,
)
from treespec.backends.hf import HFRunner
from treespec.backends.native import NativeRunner
from treespec.sequoia import TreeShape

from .conftest import tiny_llama
from .heads import head_runner, random_head
from .llamas import GREEDY, PROMPTS, hf_greedy, record_feeds
from .mc import PROMPT as MC_PROMPT
from .mc import K as MC_K
from .mc import N as MC_N
from .mc import chi2_pvalue, exact_joint, models  # noqa: F401 (fixture)
from .toy import (
    PROMPT,
    SAMPLINGS,
    K,
    TableHead,
    TableRunner,
    enumerate_outcomes,
    max_abs_diff,
    pair,
)


# ---- a random head for a tiny Llama -------------------------------------------------------
def reference(cfg, w, embed, hidden, tokens, positions):
    """The head on one sequence of rows, causal, written from EAGLE-3's definition alone:
    logits [T, V] (-inf off its rows) and output states [T, H]."""
    eps, Hq, Hkv, D = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def norm(x, name):  # HF's LlamaRMSNorm: the statistics in float32
        x32 = x.float()
        return w[name] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    T = len(tokens)
    x = torch.cat(
        [norm(embed[tokens], "midlayer.input_layernorm.weight"), norm(hidden, "midlayer.hidden_norm.weight")],
        -1,
    )
    a_ = "midlayer.self_attn."
    q = (x @ w[a_ + "q_proj.weight"].T).view(T, Hq, D)
    k = (x @ w[a_ + "k_proj.weight"].T).view(T, Hkv, D)
    v = (x @ w[a_ + "v_proj.weight"].T).view(T, Hkv, D)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2).float() / D))
    ang = torch.tensor(positions).float()[:, None] * inv[None]
    cos, sin = (
        torch.cat([ang, ang], -1).cos().double()[:, None],
        torch.cat([ang, ang], -1).sin().double()[:, None],
    )

    def rope(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = torch.einsum("hts,shd->thd", att, v).reshape(T, Hq * D)
    a = o @ w[a_ + "o_proj.weight"].T + hidden
    m_ = "midlayer.mlp."
    n = norm(a, "midlayer.post_attention_layernorm.weight")
    out = (F.silu(n @ w[m_ + "gate_proj.weight"].T) * (n @ w[m_ + "up_proj.weight"].T)) @ w[
        m_ + "down_proj.weight"
    ].T + a
    rows = norm(out, "norm.weight") @ w["lm_head.weight"].T
    logits = torch.full((T, cfg.vocab_size), float("-inf"), dtype=rows.dtype)
    logits[:, torch.arange(cfg.draft_vocab_size) + w["d2t"]] = rows
    return logits, out


# ---- the head's own forward ---------------------------------------------------------------
def test_head_tree_forward_equals_its_definition_on_every_path():
    target = tiny_llama(0)
    cfg, w = random_head(target, draft_vocab=40, seed=1)
    head = head_runner(target, cfg, w)
    embed = target.model.embed_tokens.weight.detach()
    rng = random.Random(0)
    g = torch.Generator().manual_seed(2)
    H = cfg.hidden_size
    # committed slots: a chain fed with hidden states, then committed (a round's catch-up)
    c_tok = [rng.randrange(cfg.vocab_size) for _ in range(7)]
    c_hid = torch.randn(7, H, generator=g, dtype=torch.float64)
    got = head.extend(c_tok, list(range(-1, 6)), c_hid)
    want, _ = reference(cfg, w, embed, c_hid, c_tok, list(range(7)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    head.commit(list(range(7)))
    # a tree below them, each node with a hidden state of its own
    parents = [-1, 0, 0, 1, 1, 3, 2]
    t_tok = [rng.randrange(cfg.vocab_size) for _ in parents]
    t_hid = torch.randn(len(parents), H, generator=g, dtype=torch.float64)
    got = head.extend(t_tok, parents, t_hid)
    for i in range(len(parents)):
        path = []
        j = i
        while j != -1:
            path.insert(0, j)
            j = parents[j]
        hid = torch.cat([c_hid, t_hid[path]])
        toks = c_tok + [t_tok[j] for j in path]
        want, _ = reference(cfg, w, embed, hid, toks, list(range(len(toks))))
        torch.testing.assert_close(got[i], want[-1], rtol=0, atol=1e-9)
    assert torch.isinf(got).sum(-1).eq(cfg.vocab_size - 40).all()  # q only on the head's 40 rows


def test_a_compiled_head_equals_the_eager_one(tmp_path):
    """The head's graph (`HeadRunner(compile=True)`, one graph for every feed from the store, as
    int4 heads get): the same logits and output states as the eager layer, one token and trees
    alike. Cheap inductor settings: one small graph compiles (~15 s)."""
    from treespec.backends.native import CompiledForward
    from treespec.backends.native.aot import GraphStore

    from .llamas import CHEAP

    target = tiny_llama(0).float()
    cfg, w = random_head(target, draft_vocab=40, seed=1)
    w = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
    embed = target.model.embed_tokens.weight.detach()
    eager = HeadRunner(cfg, w, embed)
    nat = HeadRunner(cfg, w, embed, compile=True)
    nat.compiled = CompiledForward(nat, CHEAP, GraphStore(tmp_path))
    nat.compiled.static_max = 0
    rng, g = random.Random(0), torch.Generator().manual_seed(2)
    feeds = [  # (nodes, their parents, the path committed): a prefill, a step, a tree
        (7, list(range(-1, 6)), list(range(7))),
        (1, [-1], [0]),
        (7, [-1, 0, 0, 1, 1, 3, 2], [0, 1, 3, 5]),
    ]
    for n, parents, path in feeds:
        tokens = [rng.randrange(cfg.vocab_size) for _ in range(n)]
        hidden = torch.randn(n, cfg.hidden_size, generator=g)
        want, got = (extend_many([(r, tokens, parents, hidden)])[0] for r in (eager, nat))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(got.features, want.features, rtol=0, atol=1e-4)
        for r in (eager, nat):
            r.commit(path)
    assert not nat.compiled.failed and set(nat.compiled.packages) == {"dynamic"}


def test_the_cost_measurement_feeds_a_compiled_head_every_size():
    """Before timing, a compiled pair's runners get one feed of every size a round may score
    (`treespec.planning.costs.compile_every_feed_size`); a feature head's come with hidden
    states in its own dtype (eager runners here: what is fed, not the compiling, is under test)."""
    from treespec.config import AUTO_MAX_NODES
    from treespec.planning.costs import compile_every_feed_size

    target = tiny_llama(0).float()
    cfg, w = random_head(target, draft_vocab=40, seed=1)
    head = HeadRunner(cfg, w, target.model.embed_tokens.weight.detach(), dtype=torch.bfloat16)
    seen = []
    extend = head.extend
    head.extend = lambda ids, parents, hidden: (
        seen.append((len(ids), hidden.dtype)) or extend(ids, parents, hidden)
    )
    compile_every_feed_size(head, list(range(40)), 16)
    assert seen == [(16, torch.bfloat16)] + [(n, torch.bfloat16) for n in range(1, AUTO_MAX_NODES + 2)]
    assert head.filled == 0  # left reset


def test_target_features_come_with_the_scores_and_equal_hf_hidden_states():
    """Taps are layer inputs (HF's hidden_states[i]); the layer count is the last layer's
    output before the final norm. Native and HF runners return the same rows for a prefill and a
    tree, and a runner without taps computes none."""
    from treespec.backends.base import prefill_many, score_many

    model = tiny_llama(2, hidden=48, heads=6, kv_heads=2, layers=4)
    taps = (0, 2, 4)
    prompt, tree = [5, 9, 11, 3, 7], TokenTree([4, 8, 9, 10], [-1, 0, 0, 1])
    with torch.no_grad():
        ref = model(torch.tensor([prompt + [4]]), output_hidden_states=True)
    last = ref.hidden_states[-1]  # HF applies the final norm to the last entry: undo it by a hook below
    captured = {}
    h = model.model.norm.register_forward_pre_hook(lambda m, a: captured.setdefault("pre", a[0]))
    with torch.no_grad():
        model(torch.tensor([prompt + [4]]))
    h.remove()
    want = torch.cat([ref.hidden_states[0], ref.hidden_states[2], captured["pre"]], -1)[0]  # [P+1, 3H]
    assert not torch.allclose(last[0], captured["pre"][0])
    for runner in (NativeRunner.from_hf(model), HFRunner(model)):
        runner.set_taps(taps)
        (pre,) = prefill_many([(runner, prompt)])
        torch.testing.assert_close(pre.features, want[: len(prompt)], rtol=0, atol=1e-9)
        assert pre.logits is None
        (scores,) = score_many([(runner, tree)])
        torch.testing.assert_close(scores.features[0], want[-1], rtol=0, atol=1e-9)  # the root
        assert scores.features.shape == (4, 3 * 48) and scores.logits.shape == (4, model.config.vocab_size)
    plain = NativeRunner.from_hf(model)
    plain.prefill(prompt)
    assert score_many([(plain, tree)])[0].features is None
    with pytest.raises(ValueError, match=r"tap layers \[5\] are outside the target's layers \[0, 4\]"):
        plain.set_taps((1, 5))


# ---- the EAGLE-3 format -------------------------------------------------------------------
def test_eagle3_checkpoint_round_trips(tmp_path):
    target = tiny_llama(0)
    cfg, w = random_head(target, taps=(0, 1), draft_vocab=32, seed=3)
    save_head(tmp_path / "head", cfg, w)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["draft_vocab_size"] == 32
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    cfg2, w2 = load_head(tmp_path / "head")
    assert cfg2 == cfg and set(w2) == set(w)
    for name in w:
        assert torch.equal(w2[name], w[name]), name
    a, b = head_runner(target, cfg, w), head_runner(target, cfg2, w2)
    hid = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    assert torch.equal(
        a.extend([3, 4, 5, 6, 7], [-1, 0, 1, 1, 2], hid), b.extend([3, 4, 5, 6, 7], [-1, 0, 1, 1, 2], hid)
    )


def test_a_head_written_in_the_published_layout_loads(tmp_path):
    """What an EAGLE-3 release holds, written here by hand (not by save_head): a config with
    the taps under eagle_config only, bf16 tensors, d2t as int64 offsets, t2d as bools."""
    target = tiny_llama(0)
    cfg, w = random_head(target, taps=(0, 1), draft_vocab=24, seed=5)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": 24,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.bfloat16() if v.is_floating_point() else v for k, v in w.items()},
        str(tmp_path / "model.safetensors"),
    )
    cfg2, w2 = load_head(tmp_path)
    assert cfg2.taps == (0, 1) and cfg2.draft_vocab_size == 24 and cfg2.head_dim == cfg.hidden_size // 4
    head = HeadRunner(cfg2, w2, target.model.embed_tokens.weight.detach())
    assert head.dtype == torch.float32 and torch.equal(head.ids, torch.arange(24) + w["d2t"])


def test_bad_heads_are_clear_errors(tmp_path):
    target = tiny_llama(0)
    cfg, w = random_head(target, taps=(0, 1), draft_vocab=16, seed=6)
    save_head(tmp_path, cfg, w)
    config = json.loads((tmp_path / "config.json").read_text())
    for edit, match in [
        ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
        ({"num_hidden_layers": 2}, "with 2 layers are not supported"),
        ({"draft_vocab_size": 17}, r"lm_head.weight has shape \(16, 32\), the config says \(17, 32\)"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ValueError, match=match):
            load_head(tmp_path)
    bad = dict(w, d2t=torch.zeros(16, dtype=torch.int64))  # row r onto target id r ...
    bad["d2t"][1] = -1  # ... but rows 0 and 1 both onto target id 0
    with pytest.raises(ValueError, match="d2t must map the draft rows to distinct target ids"):
        save_head(tmp_path / "x", cfg, bad)
    with pytest.raises(ValueError, match="lacks the tensor 'fc.weight'"):
        save_head(tmp_path / "y", cfg, {k: v for k, v in w.items() if k != "fc.weight"})
    other = tiny_llama(1, hidden=16, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="embedding of 96 x 32, the target's is \\(96, 16\\)"):
        HeadRunner(cfg, w, other.model.embed_tokens.weight.detach())
    with pytest.raises(ValueError, match="reads one hidden state per token, got None"):
        head_runner(target, cfg, w).extend([1, 2], [-1, 0])
    with pytest.raises(ValueError, match="drafter='head' needs a feature head"):
        SpeculativeDecoder(target, tiny_llama(1), drafter="head").generate([1, 2, 3], 2)


# ---- lossless: enumeration on table models --------------------------------------------------
HEAD_CASES = [  # (tree, verification)
    (TreeConfig(1, 2), "token"),
    (TreeConfig(1, 2), "block"),
    (TreeConfig(2, 2), None),
    (TreeConfig(3, 1), None),
    (TreeConfig(2, 2, "without_replacement"), "token"),
    (TreeConfig(2, 2, "without_replacement"), "traversal"),
    (TreeConfig(2, 2, "topk"), None),
    (TreeConfig(2, 2, "dynamic", budget=3), None),
    (TreeConfig(depth=2, strategy="sequoia", shape=TreeShape((-1, 0, 0, 1))), None),
    (TreeConfig(1, 2, adaptive="hf", depth_min=1, depth_max=2), None),
]


def head_decoder():
    target, draft = pair()
    return target, SpeculativeDecoder(TableRunner(target), TableHead(target, draft, PROMPT[0]))


# Draws without replacement at T=1 (cases 4 and 5, ~6 s and ~4 s: the most outcomes) run with
# -m slow; both stay enumerated, under the token and the traversal rule, at the other samplings.
SLOW_HEAD_CASES = ((4, "T1"), (5, "T1"))


@pytest.mark.parametrize(
    "case,sampling_name",
    [
        pytest.param(
            c,
            s,
            id=f"{HEAD_CASES[c][0].strategy}-{c}-{s}",
            marks=pytest.mark.slow if (c, s) in SLOW_HEAD_CASES else (),
        )
        for c in range(len(HEAD_CASES))
        for s in SAMPLINGS
    ],
)
def test_feature_head_is_lossless_by_enumeration(case, sampling_name):
    tree, rule = HEAD_CASES[case]
    sampling = SAMPLINGS[sampling_name]
    target, dec = head_decoder()

    accepted = []

    def run(rng):
        out = dec.generate(
            list(PROMPT), K, tree=tree, sampling=sampling, rng=rng, ignore_eos=True, verification=rule
        )
        accepted.append(out.sources.count("accepted"))
        return tuple(out.token_ids)

    got = enumerate_outcomes(run)
    assert max(accepted) > 0  # the head's proposals were accepted on some branches
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, target.joint(PROMPT, K, sampling)) < 1e-9


def test_feature_head_with_plain_rounds_and_a_one_token_prompt_is_lossless():
    """Rounds that draft nothing (depth capped by the tokens left, goodput's plain rounds)
    still hand the head their features; a one-token prompt has none to read at first."""
    target, draft = pair()
    sampling = SAMPLINGS["T1"]
    for prompt, tree in [((1,), TreeConfig(1, 2)), (PROMPT, TreeConfig(1, 3, plain_fallback=True))]:
        dec = SpeculativeDecoder(TableRunner(target), TableHead(target, draft, prompt[0]))

        def run(rng):
            out = dec.generate(list(prompt), K, tree=tree, sampling=sampling, rng=rng, ignore_eos=True)
            return tuple(out.token_ids)

        assert max_abs_diff(enumerate_outcomes(run), target.joint(tuple(prompt), K, sampling)) < 1e-9


def test_feature_head_batched_rounds_are_each_request_alone():
    target, draft = pair()
    dec = SpeculativeDecoder(TableRunner(target), TableHead(target, draft, PROMPT[0]))
    prompts = [list(PROMPT), list(PROMPT) + [2], list(PROMPT) + [1, 1]]
    settings = dict(tree=TreeConfig(2, 2), sampling=SAMPLINGS["T1"], ignore_eos=True)
    solo = [dec.generate(p, 6, seed=s, **settings).token_ids for s, p in enumerate(prompts)]
    batch = dec.generate_batch(prompts, 6, seeds=[0, 1, 2], **settings)
    assert [o.token_ids for o in batch] == solo


# ---- lossless on tiny Llamas ----------------------------------------------------------------
@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize(
    "tree",
    [TreeConfig(1, 3), TreeConfig(2, 3), TreeConfig(3, 3, "topk"), TreeConfig(3, 4, "dynamic", budget=6)],
    ids=["chain", "iid", "topk", "dynamic"],
)
def test_greedy_with_a_head_equals_hf_generate(tree, backend):
    target = tiny_llama(0)
    cfg, w = random_head(target, draft_vocab=64, seed=7)
    dec = SpeculativeDecoder(target, head_runner(target, cfg, w), backend=backend)
    assert dec.drafter.kind == "head"
    for prompt in PROMPTS[:4]:
        out = dec.generate(prompt, 12, tree=tree, sampling=GREEDY, ignore_eos=True)
        assert out.token_ids == hf_greedy(target, prompt, 12, stop_at_eos=False)
        assert out.stats.draft_forwards > 0


def test_a_batch_with_a_head_equals_each_request_alone_in_float64():
    target = tiny_llama(0)
    cfg, w = random_head(target, draft_vocab=64, seed=8)
    dec = SpeculativeDecoder(target, head_runner(target, cfg, w))
    settings = dict(tree=TreeConfig(2, 2), sampling=SamplingConfig(temperature=0.8), ignore_eos=True)
    prompts = PROMPTS[1:5]
    solo = [dec.generate(p, 10, seed=i, **settings).token_ids for i, p in enumerate(prompts)]
    batch = dec.generate_batch(prompts, 10, seeds=list(range(len(prompts))), **settings)
    assert [o.token_ids for o in batch] == solo


@pytest.mark.parametrize(
    "tree,sampling",
    [
        pytest.param(TreeConfig(2, 2), SamplingConfig(temperature=1.0), id="iid"),
        pytest.param(  # draws without replacement are in the enumeration above, exactly
            TreeConfig(2, 2, "without_replacement"),
            SamplingConfig(temperature=0.9, top_p=0.9),
            id="without_replacement-topp",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_sampling_with_a_head_matches_the_target_chi_square(models, tree, sampling):  # noqa: F811
    target, _ = models
    cfg, w = random_head(target, taps=(0, 1, 2), draft_vocab=6, seed=9)
    dec = SpeculativeDecoder(target, head_runner(target, cfg, w))
    counts, accepted = Counter(), 0
    for seed in range(MC_N):
        out = dec.generate(MC_PROMPT, MC_K, tree=tree, sampling=sampling, seed=seed, ignore_eos=True)
        counts[tuple(out.token_ids)] += 1
        accepted += out.sources.count("accepted")
    assert accepted > MC_N // 10  # the head's proposals were really used
    assert chi2_pvalue(counts, exact_joint(target, sampling), MC_N) > 1e-3
    other = SamplingConfig(temperature=sampling.temperature * 1.6, top_p=sampling.top_p)
    assert chi2_pvalue(counts, exact_joint(target, other), MC_N) < 1e-3


def test_training_time_test_computes_what_drafting_computes():
    """The training forward's unrolled step j at slot t (EAGLE-3's training-time test) equals
    the head drafting j levels below the root: target-fed slots up to t - j, then a chain of j
    nodes each fed its parent's output state."""
    from treespec.distill.head_model import HeadModel

    target = tiny_llama(0)
    cfg, w = random_head(target, taps=(0, 1, 2), draft_vocab=48, seed=11)
    w32 = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
    embed = target.model.embed_tokens.weight.detach().float()
    model = HeadModel(cfg, embed, w32)
    g = torch.Generator().manual_seed(3)
    n = 9
    feats = torch.randn(n, 3 * cfg.hidden_size, generator=g)
    x = torch.randint(2, cfg.vocab_size, (n + 1,), generator=g)
    with torch.no_grad():
        steps = model(feats[None], x[1:][None], unroll=2)  # slot t reads (f_t, x_{t+1})
    for j in range(3):
        for t in range(j, n):
            head = HeadRunner(cfg, w32, embed)
            c, parent = t - j + 1, t - j  # target-fed slots 0 .. t - j, a chain of pending nodes
            (scores,) = extend_many(
                [(head, x[1 : c + 1].tolist(), list(range(-1, c - 1)), head.project(feats[:c]))]
            )
            hidden = scores.features[-1:]
            for i in range(1, j + 1):  # node i sits at slot t - j + i and reads token t - j + i + 1
                (scores,) = extend_many([(head, [int(x[t - j + i + 1])], [parent], hidden)])
                parent, hidden = head.n_pending - 1, scores.features
            logits = scores.logits[-1]
            torch.testing.assert_close(logits[head.ids], steps[j][0, t], rtol=1e-4, atol=1e-4)


def test_from_pretrained_loads_a_head_directory_over_its_target(tmp_path):
    target = tiny_llama(0).float()
    target.save_pretrained(tmp_path / "target")
    cfg, w = random_head(target, draft_vocab=50, seed=12)
    save_head(tmp_path / "head", cfg, w)
    dec = SpeculativeDecoder.from_pretrained(
        target=tmp_path / "target", draft=tmp_path / "head", dtype="float32"
    )
    assert isinstance(dec.draft_runner, HeadRunner) and dec.drafter.kind == "head"
    assert torch.equal(dec.draft_runner.embed, dec.target_runner.input_embeddings())
    prompt = PROMPTS[3]
    out = dec.generate(prompt, 10, tree=TreeConfig(2, 3), sampling=GREEDY, ignore_eos=True)
    assert out.token_ids == hf_greedy(target, prompt, 10, stop_at_eos=False)
    assert out.stats.draft_forwards > 0


@pytest.mark.parametrize("quantize", ["int8", "int4", "q4q8"])
def test_a_quantized_head_proposes_close_to_the_dense_one_and_stays_exact(tmp_path, quantize):
    """`draft_quantize` reaches a head (it was ignored there): its products are weight-only
    quantized, its logits stay near the dense head's, and the output is still the target's."""
    from treespec.backends.linear import Int4Projection, Q4Q8Projection, QuantizedProjection

    target = tiny_llama(0).float()
    target.save_pretrained(tmp_path / "target")
    cfg, w = random_head(target, draft_vocab=48, seed=12)  # int4: output rows a multiple of 16
    save_head(tmp_path / "head", cfg, w)
    decs = {
        q: SpeculativeDecoder.from_pretrained(
            target=tmp_path / "target", draft=tmp_path / "head", dtype="float32", draft_quantize=q
        )
        for q in (None, quantize)
    }
    head = decs[quantize].draft_runner
    kind = {"int8": QuantizedProjection, "int4": Int4Projection, "q4q8": Q4Q8Projection}[quantize]
    assert all(isinstance(p, kind) for p in (head.fc, head.lm_head, head.layers[0].qkv, head.layers[0].down))
    g = torch.Generator().manual_seed(0)
    tokens, hidden = (
        torch.randint(0, cfg.vocab_size, (6,), generator=g).tolist(),
        torch.randn(6, cfg.hidden_size, generator=g),
    )
    other = HeadRunner(
        *random_head(target, draft_vocab=48, seed=13), decs[None].target_runner.input_embeddings()
    )
    probs = {}
    for q, runner in ((None, decs[None].draft_runner), (quantize, head), ("other", other)):
        runner.reset()
        probs[q] = runner.extend(tokens, list(range(-1, 5)), hidden).softmax(-1)  # [6, V]
    tv = 0.5 * (probs[None] - probs[quantize]).abs().sum(-1)
    tv_other = 0.5 * (probs[None] - probs["other"]).abs().sum(-1)
    assert tv.max() < 0.25 * tv_other.min(), (tv, tv_other)  # near the dense head, far from another
    prompt = PROMPTS[3]
    out = decs[quantize].generate(prompt, 10, tree=TreeConfig(2, 3), sampling=GREEDY, ignore_eos=True)
    assert out.token_ids == hf_greedy(target, prompt, 10, stop_at_eos=False)
    assert out.stats.draft_forwards > 0


def test_draft_quantize_auto_quantizes_a_head_only_where_int4_is_faster_and_fits(tmp_path, monkeypatch):
    """`draft_quantize="auto"` (the default): int4 where this CPU's int4 products beat dense ones
    in the head's dtype and the head's rows suit torch's int4 layout, else dense."""
    from treespec.backends import cpu

    target = tiny_llama(0).float()
    target.save_pretrained(tmp_path / "target")
    for rows in (48, 50):
        cfg, w = random_head(target, draft_vocab=rows, seed=12)
        save_head(tmp_path / f"head{rows}", cfg, w)
    for faster in (True, False):
        monkeypatch.setattr(cpu, "int4_matmul_is_faster", lambda dtype, dense=None, f=faster: f)
        for rows in (48, 50):
            dec = SpeculativeDecoder.from_pretrained(
                target=tmp_path / "target", draft=tmp_path / f"head{rows}", dtype="float32"
            )
            assert dec.draft_runner.quantize == ("int4" if faster and rows == 48 else None)
            assert dec._origin["draft_quantize"] == dec.draft_runner.quantize  # the costs' key


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_chats_next_turn_reuses_the_cached_prefix_with_a_head(temperature, monkeypatch):
    """`prefix_reuse` on the target and its head (`treespec chat`): the second turn prefills only
    what the head has no features for (the new tokens and the previous turn's last round), and
    the output (float64, seeded) equals a decoder that starts from empty caches."""
    target = tiny_llama(0)
    cfg, w = random_head(target, taps=(0, 1), seed=5)
    fresh, reusing = (
        SpeculativeDecoder(target, head_runner(target, cfg, w), drafter="head") for _ in range(2)
    )
    for runner in (reusing.target_runner, reusing.draft_runner):
        runner.prefix_reuse = True
    settings = dict(tree=TreeConfig(1, 3), sampling=SamplingConfig(temperature=temperature), ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10]
    first = reusing.generate(prompt, 12, seed=0, **settings)
    second_prompt = prompt + first.token_ids + [5, 9]  # the next turn extends the first
    fed = record_feeds(monkeypatch)
    got = reusing.generate(second_prompt, 12, seed=1, **settings)
    target_prefill = fed[0]
    monkeypatch.undo()
    want = fresh.generate(second_prompt, 12, seed=1, **settings)
    assert got.token_ids == want.token_ids
    new = 2 + 1  # the two new tokens and turn 1's last token, which no forward fed
    # the head lags the target by the positions of turn 1's last round, whose features it queued
    assert new < target_prefill <= new + 3 < len(second_prompt) - 1, target_prefill
    third = reusing.generate([4] + second_prompt[1:], 6, seed=2, **settings)  # another first token
    assert third.token_ids == fresh.generate([4] + second_prompt[1:], 6, seed=2, **settings).token_ids
