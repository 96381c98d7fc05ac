"""`treespec distill`: input checks, learning, loading, exact resume, and lossless subset drafts.

The end-to-end runs distill a tiny random Llama (96-word vocabulary, a word-level tokenizer
built in-process) in a few seconds each; the subset-vocabulary runner is proven lossless by
exact enumeration on table models and by a chi-square test on a tiny Llama.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
from collections import Counter

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.backends import make_runner
from treespec.backends.subset import full_vocabulary_model
from treespec.distill import (
    Recipe,
    SubsetVocabRunner,
    VocabMap,
    cli,
    distill,
    load_draft,
    losses,
    prompts,
    train,
)
from treespec.distill.pipeline import choose_subset
from treespec.drafters.counts import BigramDrafter, load_counts

from .conftest import VOCAB, tiny_llama
from .mc import PROMPT, K, N, V, chi2_pvalue, exact_joint, models  # noqa: F401 (fixture)
from .toy import TableModel, TableRunner, enumerate_outcomes, max_abs_diff

TINY = dict(  # a recipe that runs in seconds on the tiny target
    max_prompts=32,
    prompt_tokens=24,
    response_tokens=12,
    top_k=8,
    gen_batch=8,
    layers=1,
    hidden_size=16,
    head_dim=8,
    steps=40,
    batch_size=8,
    lr=1e-2,
    warmup_steps=5,
    evals=1,
    eval_prompts=8,
    eval_tokens=16,
    proxy_prompts=8,
    save_dtype="float32",
    threads=1,
    progress=False,
)


def word_tokenizer():
    """A word-level tokenizer over VOCAB ids: <bos>, <eos>, w2 .. w95."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """(target directory, prompt file): a 1-layer random Llama with its tokenizer, 40 prompts."""
    root = tmp_path_factory.mktemp("distill")
    model = tiny_llama(0, hidden=32, layers=1, dtype=torch.float32)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(root / "target")
    word_tokenizer().save_pretrained(root / "target")
    rng = random.Random(0)
    lines = [" ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(rng.randrange(5, 12))) for _ in range(40)]
    (root / "prompts.txt").write_text("\n".join(lines) + "\n")
    return root / "target", root / "prompts.txt"


@pytest.fixture(scope="module")
def distilled(tiny_target, tmp_path_factory):
    target, prompt_file = tiny_target
    out = tmp_path_factory.mktemp("run") / "draft"
    distill(target, out, prompts=prompt_file, **TINY)
    return out


# ---- inputs ----------------------------------------------------------------------------------
def test_bad_inputs_are_one_line_errors_before_any_work(tiny_target, tmp_path):
    target, prompt_file = tiny_target
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = tmp_path / "out"
    cases = {
        "does not exist": dict(target=tmp_path / "missing", out_dir=out),
        "no prompts in": dict(target=target, out_dir=out, prompts=empty),
        "no prompt file": dict(target=target, out_dir=out, prompts=tmp_path / "nope.txt"),
        "cannot write": dict(target=target, out_dir=blocker / "sub"),
        "minutes must be": dict(target=target, out_dir=out, minutes=0),
        "minutes must be ": dict(target=target, out_dir=out, minutes=-2.5),
        "unknown recipe option": dict(target=target, out_dir=out, layer=3),
        "loss must be": dict(target=target, out_dir=out, loss="mse"),
        "nothing to resume": dict(target=target, out_dir=out, resume=True),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message.strip()) as e:
            distill(**kwargs)
        assert "\n" not in str(e.value)
        assert not (out / "work").exists()
    (out / "old.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        distill(target, out, prompts=prompt_file)


def test_prompt_files_and_chat_rendering(tmp_path):
    (tmp_path / "a.txt").write_text("first\n\nsecond\n")
    (tmp_path / "b.jsonl").write_text(
        '"plain"\n{"instruction": "do it"}\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    chat = [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]
    ]
    (tmp_path / "c.json").write_text(json.dumps(chat))
    assert prompts.load_prompt_file(tmp_path / "a.txt") == ["first", "second"]
    assert prompts.load_prompt_file(tmp_path / "b.jsonl")[:2] == ["plain", "do it"]
    (conversation,) = prompts.load_prompt_file(tmp_path / "c.json")
    assert [m["role"] for m in conversation] == ["system", "user"]  # cut after the last user turn
    tok = word_tokenizer()
    with pytest.raises(ValueError, match="no chat template"):
        prompts.check_renderable([conversation], tok)
    assert prompts.render("w5 w6 w7", tok, 2) == [5, 6]
    tok.chat_template = (
        "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
        "{% if add_generation_prompt %}w4{% endif %}"
    )
    assert prompts.render("w9", tok, 10) == [2, 9, 3, 4]
    assert prompts.render("w9 w9 w9 w9", tok, 4) is None  # a chat that does not fit is skipped


def test_bundled_prompt_sets_keep_their_held_out_parts_apart():
    chat_train = set(prompts._jsonl_prompts(prompts.CHAT_TRAIN))
    chat_held = prompts._jsonl_prompts(prompts.CHAT_HELDOUT)
    assert len(chat_train) >= 2000 and len(chat_held) == 64 and not chat_train & set(chat_held)
    from treespec.zoo import ZOO

    held = json.loads((ZOO / "pycode" / "heldout_prompts.json").read_text())["heldout_files"]
    files = prompts.stdlib_training_files()
    assert len(files) > 500 and not set(held) & set(files)
    assert len(prompts.stdlib_snippets(seed=0)) > 5000


# ---- losses ----------------------------------------------------------------------------------
def test_bucketed_losses_equal_full_vocabulary_ones_when_k_is_v():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 7, generator=g) * 2, -1)
    logq = torch.log_softmax(torch.randn(5, 7, generator=g) * 2, -1)
    q = logq.exp()
    ids = torch.arange(7).expand(5, 7)
    P, Q, logQ = losses.buckets(logq, ids, p, torch.ones(5, 7, dtype=torch.bool))
    assert torch.allclose(losses.divergence("kl", P, Q, logQ), (p * (p.log() - logq)).sum(-1), atol=1e-6)
    assert torch.allclose(losses.divergence("tv", P, Q, logQ), 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert torch.allclose(losses.alpha_lower_bound(P, Q), torch.minimum(p, q).sum(-1), atol=1e-6)
    m = 0.5 * (p + q)
    jsd = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    assert torch.allclose(losses.divergence("jsd", P, Q, logQ), jsd, atol=1e-6)
    # top-3 of 7: every divergence is a lower bound, and zero for q == p
    top = torch.topk(p, 3, dim=-1)
    P3, Q3, logQ3 = losses.buckets(logq, top.indices, top.values, torch.ones(5, 3, dtype=torch.bool))
    for name in ("kl", "tv", "jsd"):
        assert (losses.divergence(name, P3, Q3, logQ3) <= losses.divergence(name, P, Q, logQ) + 1e-6).all()
        Pp, Qp, logQp = losses.buckets(p.log(), top.indices, top.values, torch.ones(5, 3, dtype=torch.bool))
        assert losses.divergence(name, Pp, Qp, logQp).abs().max() < 1e-6


# ---- end to end ------------------------------------------------------------------------------
def test_distill_learns_and_its_output_loads_in_treespec_and_hf(distilled, tiny_target):
    target, _ = tiny_target
    rows = [json.loads(line) for line in (distilled / "eval.jsonl").read_text().splitlines()]
    init, trained = rows[0], rows[-1]
    assert init["step"] == 0 and trained["final"] and trained["step"] == TINY["steps"]
    summary = json.loads((distilled / "distill.json").read_text())
    (d,) = summary["drafts"]
    assert d["loss_last_10pct"] < 0.7 * d["loss_first"]
    assert trained["proxy"]["alpha"] > init["proxy"]["alpha"] + 0.05
    assert trained["T0"]["acceptance_by_depth"][0] > init["T0"]["acceptance_by_depth"][0] + 0.1
    shipped = json.loads((distilled / "acceptance.json").read_text())  # the automatic tree's input
    assert shipped["T0"]["acceptance"][0] > 0.2 and shipped["prompts"] == TINY["eval_prompts"]
    assert (
        summary["data"]["train_prompts"] == TINY["max_prompts"]
        and summary["recipe"]["steps"] == TINY["steps"]
    )
    assert (distilled / "eval.png").stat().st_size > 1000
    # the counts of the same text: unigram counts of every stored token, bigrams within sequences
    counts = load_counts(distilled / "counts.npz")
    sequences = json.loads((distilled / "work" / "data" / "meta.json").read_text())["prompts"]
    assert counts["unigram"].size == VOCAB and counts["bigram_indptr"][-1] == counts["bigram_indices"].size
    assert counts["unigram"].sum() - counts["bigram_counts"].sum() == sequences  # one bigram fewer each
    assert BigramDrafter(counts_file=distilled / "counts.npz").vocab_size == VOCAB
    # treespec: greedy speculative output == the target's own greedy decoding
    dec = SpeculativeDecoder.from_pretrained(target=target, draft=distilled, dtype="float32")
    plain = dec.generate("w5 w9 w17", 12, tree=None, sampling=SamplingConfig(temperature=0), ignore_eos=True)
    spec = dec.generate(
        "w5 w9 w17", 12, tree=TreeConfig(1, 4), sampling=SamplingConfig(temperature=0), ignore_eos=True
    )
    assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0
    # transformers: assisted generation with the draft as the assistant model
    from transformers import AutoModelForCausalLM

    t = AutoModelForCausalLM.from_pretrained(target)
    a = AutoModelForCausalLM.from_pretrained(distilled)
    ids = torch.tensor([[5, 9, 17]])
    ref = t.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assisted = t.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, assistant_model=a)
    assert torch.equal(ref, assisted)


def test_data_from_reuses_another_runs_data(distilled, tiny_target, tmp_path, monkeypatch):
    target, prompt_file = tiny_target
    from treespec.distill import data as data_module

    with pytest.raises(ValueError, match="other response_tokens"):
        distill(
            target, tmp_path / "a", prompts=prompt_file, data_from=distilled, **{**TINY, "response_tokens": 9}
        )
    from treespec.distill import pipeline

    for module in (data_module, pipeline):  # nothing may be generated
        monkeypatch.setattr(module, "make_shard", None)
    out = distill(target, tmp_path / "b", prompts=prompt_file, data_from=distilled, **{**TINY, "loss": "tv"})
    for shard in (distilled / "work" / "data").glob("*.safetensors"):
        assert (out / "work" / "data" / shard.name).read_bytes() == shard.read_bytes()
    assert json.loads((out / "distill.json").read_text())["data"]["from"] == str(distilled)


def test_data_from_several_runs_trains_on_their_samples_together(
    distilled, tiny_target, tmp_path, monkeypatch
):
    """Runs with other seeds sampled other responses to the same prompts: their shards together,
    the first run's held-out shard, nothing generated; one seed twice or a changed prompt file
    (other held-out prompts) is refused before anything is written. A data-only run makes the
    data and no draft."""
    target, prompt_file = tiny_target
    other = tmp_path / "seed1"
    distill(target, other, prompts=prompt_file, data_only=True, **{**TINY, "seed": 1})
    assert not (other / "config.json").exists() and not (other / "work" / "draft_1.pt").exists()
    with pytest.raises(ValueError, match="data_only"):
        distill(target, other, prompts=prompt_file, resume=True, **{**TINY, "seed": 1})
    with pytest.raises(ValueError, match="nothing to do"):
        distill(target, tmp_path / "x", prompts=prompt_file, data_only=True, data_from=other, **TINY)
    with pytest.raises(ValueError, match="distinct seeds"):
        distill(target, tmp_path / "twice", prompts=prompt_file, data_from=[distilled, distilled], **TINY)
    assert not (tmp_path / "twice" / "work").exists()

    from treespec.distill import data as data_module
    from treespec.distill import pipeline

    for module in (data_module, pipeline):  # nothing may be generated
        monkeypatch.setattr(module, "make_shard", None)
    out = distill(target, tmp_path / "both", prompts=prompt_file, data_from=[distilled, other], **TINY)
    shards = [sorted((run / "work" / "data").glob("shard_*")) for run in (distilled, other)]
    got = sorted((out / "work" / "data").glob("shard_*"))
    assert [f.read_bytes() for f in got] == [f.read_bytes() for f in shards[0] + shards[1]]
    held = out / "work" / "data" / "heldout.safetensors"
    assert held.read_bytes() == (distilled / "work" / "data" / "heldout.safetensors").read_bytes()
    summary = json.loads((out / "distill.json").read_text())
    assert summary["data"]["from"] == [str(distilled), str(other)]
    one = json.loads((distilled / "distill.json").read_text())["data"]
    assert summary["data"]["stored_positions"] > one["stored_positions"]
    assert summary["data"]["train_prompts"] == 2 * one["train_prompts"]

    monkeypatch.undo()
    changed = tmp_path / "changed.txt"  # one path, other contents: other held-out prompts
    lines = prompt_file.read_text().splitlines()
    changed.write_text("\n".join(lines) + "\n")
    before = tmp_path / "before"
    distill(target, before, prompts=changed, data_only=True, **TINY)
    changed.write_text("\n".join(reversed(lines)) + "\n")
    after = tmp_path / "after"
    distill(target, after, prompts=changed, data_only=True, **{**TINY, "seed": 1})
    with pytest.raises(ValueError, match="holds out other prompts"):
        distill(target, tmp_path / "mixed", prompts=changed, data_from=[before, after], **TINY)


def failing_after(n, real):
    """`real`, raising KeyboardInterrupt from its (n+1)-th call on: a run cut at that point."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] > n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return wrapped


def test_resume_after_interruptions_reproduces_the_uninterrupted_run(tiny_target, tmp_path, monkeypatch):
    target, prompt_file = tiny_target
    recipe = {**TINY, "steps": 12, "evals": 2, "checkpoint_minutes": 0}
    distill(target, tmp_path / "whole", prompts=prompt_file, **recipe)

    from treespec.distill import data as data_module

    out = tmp_path / "cut"
    monkeypatch.setattr(data_module, "make_shard", failing_after(2, data_module.make_shard))  # 2 of 4 shards
    with pytest.raises(KeyboardInterrupt):
        distill(target, out, prompts=prompt_file, **recipe)
    monkeypatch.undo()
    monkeypatch.setattr(train, "batch_loss", failing_after(7, train.batch_loss))
    with pytest.raises(KeyboardInterrupt):
        distill(target, out, prompts=prompt_file, resume=True)
    assert torch.load(out / "work" / "draft_1.pt", weights_only=False)["step"] == 7
    monkeypatch.undo()
    distill(target, out, prompts=prompt_file, resume=True)

    whole = torch.load(tmp_path / "whole" / "work" / "draft_1.pt", weights_only=False)
    cut = torch.load(out / "work" / "draft_1.pt", weights_only=False)
    assert whole["step"] == cut["step"] == 12 and whole["losses"] == cut["losses"]
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, cut["model"][name]), name
    assert (tmp_path / "whole" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    steps = [r["step"] for r in map(json.loads, (out / "eval.jsonl").read_text().splitlines())]
    assert steps == [0, 6, 12, 12]  # evaluations past the checkpoint were dropped and redone once
    with pytest.raises(ValueError, match="cannot change lr"):
        distill(target, out, prompts=prompt_file, resume=True, lr=0.5)


def test_cli_runs_boost_tuned_subset_vocabulary_drafts(tiny_target, tmp_path):
    target, prompt_file = tiny_target
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if not isinstance(v, bool)]
    args = parser.parse_args(
        [
            "--target",
            str(target),
            "--out",
            str(tmp_path / "o"),
            "--prompts",
            str(prompt_file),
            *flags,
            "--drafts",
            "2",
            "--vocab-subset",
            "48",
            "--steps",
            "20",
            "--no-progress",
        ]
    )
    assert args.progress is False and args.vocab_subset == 48 and args.steps == 20
    cli.run(args)
    summary = json.loads((tmp_path / "o" / "distill.json").read_text())
    assert [d["dir"] for d in summary["drafts"]] == [".", "boost_2"]
    assert 0.5 < summary["vocab_subset"]["response_mass_inside"] < 1
    assert summary["merged"]["T1"]["tokens_per_step"] >= 1
    model, vocab_map = load_draft(tmp_path / "o" / "boost_2")
    assert model.config.vocab_size == 49 and vocab_map.size == 48 and vocab_map.target_vocab == VOCAB
    first, _ = load_draft(tmp_path / "o")
    assert not torch.equal(
        first.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight
    )
    # a subset draft directory is an ordinary draft to every loader: from_pretrained wraps it
    # (vocab_map.json) on both backends, and greedy speculation equals plain greedy decoding
    greedy = SamplingConfig(temperature=0)
    plain = SpeculativeDecoder.from_pretrained(target=target, dtype="float32").generate(
        [5, 6, 7], 12, tree=None, sampling=greedy, ignore_eos=True
    )
    for backend in ("native", "hf"):
        dec = SpeculativeDecoder.from_pretrained(
            target=target, draft=tmp_path / "o", dtype="float32", backend=backend
        )
        assert isinstance(dec.draft_runner, SubsetVocabRunner) and dec.draft_runner.vocab_size == VOCAB
        out = dec.generate([5, 6, 7], 12, tree=TreeConfig(2, 3), sampling=greedy, ignore_eos=True)
        assert out.token_ids == plain.token_ids


# ---- subset vocabulary: lossless ----------------------------------------------------------
def test_full_vocabulary_model_has_the_subset_runners_distribution():
    """The HF model HF assisted generation runs for a subset draft: logits equal the subset
    runner's, -inf outside the subset included, for ids inside and outside it."""
    draft = tiny_llama(5, hidden=16, layers=1, heads=2, kv_heads=1, vocab=5)
    vm = VocabMap([1, 3, 6, 7], target_vocab=9)
    full = full_vocabulary_model(draft, vm)
    ids = [6, 2, 7, 0, 3]
    expected = SubsetVocabRunner(make_runner(draft, "hf"), vm).extend(ids, [-1, 0, 1, 2, 3])
    with torch.no_grad():
        got = full(torch.tensor([ids])).logits[0]
    assert full.config.vocab_size == 9 and got.shape == (5, 9)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[:, vm.ids], expected[:, vm.ids], atol=1e-6, rtol=0)
    assert draft.config.vocab_size == 5  # the draft itself is untouched


def test_subset_runner_scatters_into_the_target_vocabulary():
    draft = tiny_llama(5, hidden=16, layers=1, heads=2, kv_heads=1, vocab=5)
    vm = VocabMap([1, 3, 6, 7], target_vocab=9)
    runner = SubsetVocabRunner(make_runner(draft), vm)
    logits = runner.extend([6, 2, 7], [-1, 0, 1])  # 2 is outside the subset: read as row 4
    with torch.no_grad():
        ref = draft(torch.tensor([[2, 4, 3]])).logits[0]
    assert runner.vocab_size == 9 and logits.shape == (3, 9)
    assert torch.allclose(logits[:, [1, 3, 6, 7]], ref[:, :4], atol=1e-9)
    assert torch.isinf(logits[:, [0, 2, 4, 5, 8]]).all()
    runner.commit([0, 1])
    assert runner.committed == [6, 2] and runner.inner.n_committed == 2
    (after,) = runner.extend([3], [-1])  # the draft's cache holds the committed rows 2, 4
    with torch.no_grad():
        ref = draft(torch.tensor([[2, 4, 1]])).logits[0, -1]  # 3 is row 1
    assert torch.allclose(after[[1, 3, 6, 7]], ref[:4], atol=1e-9)
    assert choose_subset(torch.tensor([0.0, 5, 1, 9, 0]).numpy(), 3, always=[0]) == [0, 1, 3]


@pytest.mark.parametrize(
    "tree", [TreeConfig(1, 2), TreeConfig(2, 2), TreeConfig(2, 1, "without_replacement")]
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_subset_vocabulary_draft_is_lossless_by_enumeration(tree, temperature):
    target = TableModel(4, seed=21)
    draft = TableModel(3, seed=22)  # rows 0, 1 = target ids 0, 2; row 2 = ids 1 and 3 (never proposed)
    dec = SpeculativeDecoder(TableRunner(target), SubsetVocabRunner(TableRunner(draft), VocabMap([0, 2], 4)))
    sampling = SamplingConfig(temperature=temperature)

    def run(rng):
        out = dec.generate([1, 3], 3, tree=tree, sampling=sampling, rng=rng, ignore_eos=True)
        assert all(t in (0, 2) for t, s in zip(out.token_ids, out.sources) if s == "accepted")
        return tuple(out.token_ids)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target.joint((1, 3), 3, sampling)) < 1e-9


def subset_copy(model, ids: list[int]):
    """`model` restricted to the vocabulary `ids` (+ one row for every other token)."""
    draft = copy.deepcopy(model)
    rest = [i for i in range(model.config.vocab_size) if i not in ids]
    with torch.no_grad():
        for m in (draft.model.embed_tokens, draft.lm_head):
            w = m.weight
            m.weight = torch.nn.Parameter(torch.cat([w[ids], w[rest].mean(0, keepdim=True)]))
    draft.config.vocab_size = len(ids) + 1
    return draft


def test_subset_vocabulary_draft_is_lossless_by_chi_square(models):  # noqa: F811 (fixture)
    target, _ = models
    ids = [0, 2, 3, 5, 6]
    draft = SubsetVocabRunner(make_runner(subset_copy(target, ids)), VocabMap(ids, V))
    dec = SpeculativeDecoder(target, draft)
    sampling = SamplingConfig(temperature=1.0)
    outs = dec.generate_batch(
        [PROMPT] * N,
        K,
        tree=TreeConfig(2, 2),
        sampling=sampling,
        seeds=list(range(N)),
        ignore_eos=True,
        max_batch=50,
    )
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert sum(o.sources.count("accepted") for o in outs) > N // 5  # the subset draft was really used
    assert chi2_pvalue(counts, exact_joint(target, sampling), N) > 1e-3


def test_recipe_checks_every_field():
    assert Recipe().loss == "kl"
    for bad in (
        dict(top_k=0),
        dict(temperature=-1),
        dict(data_fraction=1.0),
        dict(hidden_size=40, head_dim=32),
        dict(embeddings="svd"),
        dict(save_dtype="int8"),
        dict(target_dtype="float64"),
        dict(from_target=True, hidden_size=64),
        dict(from_target=True, embeddings="random"),
        dict(steps=True),
    ):
        with pytest.raises(ValueError):
            Recipe(**bad)


@pytest.mark.parametrize("llama32", [False, True])
def test_from_target_draft_is_a_slice_of_the_target(llama32):
    from treespec.distill.model import build_draft, target_layers

    target = tiny_llama(3, hidden=32, layers=4, dtype=torch.float32, llama32=llama32)
    ids = torch.tensor([[5, 17, 3, 40, 8, 21]])
    # every layer kept: the draft is the target, logit for logit (tied or not, as the target)
    whole = build_draft(target, Recipe(from_target=True, layers=4), None, seed=0)
    assert torch.allclose(whole(ids).logits, target(ids).logits, atol=1e-5)
    # two layers: the first and the last, at the target's width, heads and RoPE
    assert target_layers(4, 2) == [0, 3] and target_layers(4, 1) == [0]
    sliced = build_draft(target, Recipe(from_target=True, layers=2), None, seed=0)
    assert sliced.config.hidden_size == 32 and sliced.config.num_key_value_heads == 2
    for mine, theirs in zip(sliced.model.layers, (target.model.layers[0], target.model.layers[3])):
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(mine.self_attn.k_proj.weight, theirs.self_attn.k_proj.weight)
    # a subset vocabulary keeps the target's embedding rows of its tokens
    vocab_map = VocabMap([1, 5, 9], VOCAB)
    small = build_draft(target, Recipe(from_target=True, layers=2, vocab_subset=3), vocab_map, seed=0)
    for get in ("get_input_embeddings", "get_output_embeddings"):
        assert torch.equal(getattr(small, get)().weight[:3], getattr(target, get)().weight[[1, 5, 9]])
    with pytest.raises(ValueError, match="layers"):
        build_draft(target, Recipe(from_target=True, layers=5), None, seed=0)


def test_cli_passes_data_from_and_data_only(tmp_path, monkeypatch):
    """`--data-from A B` reaches distill() as the list of runs (the flag once did nothing), and
    `--data-only` as data_only."""
    from treespec.distill import pipeline

    seen = {}

    def fake_distill(target, out, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(pipeline, "distill", fake_distill)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--target", "t", "--out", str(tmp_path), "--data-from", "runA", "runB"])
    with pytest.raises(SystemExit):
        cli.run(args)
    assert seen["data_from"] == ["runA", "runB"] and seen["data_only"] is False
    with pytest.raises(SystemExit):
        cli.run(parser.parse_args(["--target", "t", "--out", str(tmp_path), "--data-only"]))
    assert seen["data_only"] is True and seen["data_from"] is None


@pytest.mark.parametrize("train_on_prompt", [True, False])
def test_stored_rows_are_the_targets_distributions(tiny_target, train_on_prompt):
    """A shard's response rows (the distributions the responses were sampled from, reported by
    generation) equal one teacher-forced forward over prompt + response; its prompt rows are
    that forward's when the draft learns prompts, else empty (-1, probability 0)."""
    from transformers import AutoModelForCausalLM

    from treespec.distill.data import Dataset, make_shard, teacher_topk

    target = AutoModelForCausalLM.from_pretrained(tiny_target[0], dtype=torch.float32).eval()
    recipe = Recipe(**{**TINY, "train_on_prompt": train_on_prompt, "temperature": 0.7})
    prompts = [[0, 5, 9, 17], [0, 40, 41], [0, 3, 3, 3, 3, 8]]
    shard = make_shard(SpeculativeDecoder(target, None), target, prompts, [1, 2, 3], recipe)
    stored = Dataset([shard])
    assert stored.prompts() == prompts
    ref_ids, ref_probs = teacher_topk(target, [s.tolist() for s in stored.sequences()], recipe.top_k)
    resp = stored.response_rows()
    prompt_rows = ~resp
    assert (shard["topk_ids"][resp] == ref_ids[resp]).mean() > 0.99  # ties aside
    np.testing.assert_allclose(shard["topk_probs"][resp], ref_probs[resp], atol=2e-3)
    if train_on_prompt:
        assert (shard["topk_ids"][prompt_rows] == ref_ids[prompt_rows]).all()
        np.testing.assert_allclose(shard["topk_probs"][prompt_rows], ref_probs[prompt_rows], atol=2e-3)
    else:
        assert (shard["topk_ids"][prompt_rows] == -1).all() and not shard["topk_probs"][prompt_rows].any()


def test_distill_head_trains_a_head_on_a_runs_data_that_loads_and_drafts(distilled, tiny_target, tmp_path):
    """`treespec distill --head --data-from RUN`: an EAGLE-3 checkpoint and head.json with the
    curve; the head loads over its target and drafts losslessly (greedy == the target's)."""
    from treespec.backends.head import HeadRunner
    from treespec.distill.head import distill_head

    target, _ = tiny_target
    out = distill_head(
        target, tmp_path / "head", distilled, minutes=0.05, vocab_subset=40, evals=1,
        eval_prompts=2, eval_tokens=4, dtype="float32", progress=False,
    )  # fmt: skip
    summary = json.loads((out / "head.json").read_text())
    assert summary["steps"] > 0 and [p["step"] for p in summary["curve"]] == [0, summary["steps"]]
    shipped = json.loads((out / "acceptance.json").read_text())  # what the automatic tree plans with
    assert shipped["T0"]["visits"][0] > 0 and 0 <= shipped["T1"]["acceptance"][0] <= 1
    assert summary["recipe"]["taps"] == [0] and summary["data"]["response_positions"] > 0
    dec = SpeculativeDecoder.from_pretrained(target=target, draft=out, dtype="float32")
    assert isinstance(dec.draft_runner, HeadRunner) and dec.draft_runner.cfg.draft_vocab_size == 40
    prompt = [5, 6, 7, 8]
    plain = dec.generate(prompt, 8, tree=None, sampling=SamplingConfig(temperature=0), ignore_eos=True)
    spec = dec.generate(
        prompt, 8, tree=TreeConfig(2, 2), sampling=SamplingConfig(temperature=0), ignore_eos=True
    )
    assert spec.token_ids == plain.token_ids and spec.stats.draft_forwards > 0


def test_a_head_trained_on_from_another_starts_as_it_and_keeps_its_rows(distilled, tiny_target, tmp_path):
    """`--init-from HEAD`: training starts from the checkpoint's tensors (a step of lr 1e-12
    leaves every bf16 tensor as it was), with its taps and draft rows; a head that does not fit
    the target or the recipe's taps is refused before any feature is computed."""
    from treespec.distill.head import distill_head

    target, _ = tiny_target
    recipe = dict(evals=0, eval_prompts=2, eval_tokens=4, dtype="float32", progress=False, acceptance=False)
    first = distill_head(target, tmp_path / "first", distilled, steps=3, vocab_subset=40, taps=[0], **recipe)
    again = distill_head(
        target, tmp_path / "again", distilled, steps=1, lr=1e-12, init_from=str(first), **recipe
    )
    a, b = (load_file(str(d / "model.safetensors")) for d in (first, again))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((again / "head.json").read_text())["recipe"]["taps"] == [0]
    with pytest.raises(ValueError, match=r"the head reads layers \[0\], the recipe's taps are \[1\]"):
        distill_head(target, tmp_path / "taps", distilled, steps=1, init_from=str(first), taps=[1], **recipe)
    with pytest.raises(ValueError, match="holds no EAGLE-3 head"):
        distill_head(target, tmp_path / "none", distilled, steps=1, init_from=str(distilled), **recipe)
    assert not list((distilled / "work" / "data").glob("features_1_*"))


def test_a_head_run_resumed_after_interruptions_equals_the_uninterrupted_one(
    distilled, tiny_target, tmp_path, monkeypatch
):
    """`distill --head --resume`: cut once while computing the features (kept beside the data
    run's shards) and once in training, the head ends bit for bit as an uninterrupted run's,
    its evaluations redone once."""
    import shutil

    from treespec.distill import features as features_module
    from treespec.distill import head as head_module

    target, _ = tiny_target
    runs = {}
    for name in ("whole", "cut"):  # two copies of one data run, so each computes its features
        runs[name] = tmp_path / f"data_{name}"
        shutil.copytree(distilled / "work", runs[name] / "work", ignore=shutil.ignore_patterns("features_*"))
    recipe = dict(
        vocab_subset=40, steps=8, evals=2, eval_prompts=2, eval_tokens=4, dtype="float32",
        checkpoint_minutes=0, progress=False, batch_size=4,
    )  # fmt: skip
    head_module.distill_head(target, tmp_path / "whole", runs["whole"], **recipe)

    out = tmp_path / "cut"
    monkeypatch.setattr(features_module, "FEATURE_CHUNK_TOKENS", 64)  # several chunks, one of them cut
    monkeypatch.setattr(features_module, "prefill_many", failing_after(2, features_module.prefill_many))
    with pytest.raises(KeyboardInterrupt):
        head_module.distill_head(target, out, runs["cut"], **recipe)
    state = runs["cut"] / "work" / "data" / "features_0_float32.json"
    assert 0 < json.loads(state.read_text())["done"] < 40
    monkeypatch.undo()
    monkeypatch.setattr(head_module, "head_loss", failing_after(5, head_module.head_loss))
    with pytest.raises(KeyboardInterrupt):
        head_module.distill_head(target, out, runs["cut"], resume=True, **recipe)
    assert torch.load(out / "work" / "head.pt", weights_only=False)["step"] == 5
    monkeypatch.undo()
    head_module.distill_head(target, out, runs["cut"], resume=True, **recipe)

    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "whole" / name).read_bytes() == (out / name).read_bytes(), name
    np.testing.assert_array_equal(
        *(np.load(runs[n] / "work" / "data" / "features_0_float32.npy") for n in ("whole", "cut"))
    )
    curve = json.loads((out / "head.json").read_text())["curve"]
    assert [r["step"] for r in curve] == [0, 4, 8] and all("top1" in r["proxy"] for r in curve)
    with pytest.raises(ValueError, match="resume cannot change lr"):
        head_module.distill_head(target, out, runs["cut"], resume=True, **{**recipe, "lr": 0.5})
    with pytest.raises(ValueError, match="not empty"):
        head_module.distill_head(target, out, runs["cut"], **recipe)


def test_cli_trains_a_head_with_its_own_recipe_flags(distilled, tiny_target, tmp_path, monkeypatch):
    """`treespec distill --head`: the recipe flags a head has reach HeadRecipe (--target-dtype as
    its dtype), the head's own ones too; a flag it has not (--layers) is ignored."""
    from treespec.distill import head as head_module

    seen = {}

    def fake(target, out, data_from, minutes, resume=False, **recipe):
        seen.update(recipe, minutes=minutes, resume=resume, data_from=data_from)
        raise SystemExit

    monkeypatch.setattr(head_module, "distill_head", fake)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--target",
            "T",
            "--out",
            "O",
            "--head",
            "--data-from",
            str(distilled),
            "--steps",
            "7",
            "--lr",
            "0.01",
        ]
        + [
            "--target-dtype",
            "float32",
            "--taps",
            "0",
            "1",
            "--unroll",
            "3",
            "--freeze-lm-head",
            "--init-from",
            "H",
            "--layers",
            "4",
        ]
    )
    with pytest.raises(SystemExit):
        cli.run(args)
    assert seen == dict(
        steps=7, lr=0.01, dtype="float32", taps=[0, 1], unroll=3, freeze_lm_head=True,
        init_from="H", minutes=None, resume=False, data_from=[str(distilled)],
    )  # fmt: skip
    with pytest.raises(ValueError, match="unroll must be an integer >= 0"):
        head_module.HeadRecipe(unroll=-1)


def test_self_written_prompts_are_the_targets_own_and_fixed_per_index(tiny_target, tmp_path):
    """prompts="self" (Magpie): the target writes the prompts; prompt i is the same whatever
    batch asks for it (a resumed run makes the same data), and a data run on them works."""
    from treespec.distill.prompts import SelfPrompts

    target, _ = tiny_target
    dec = SpeculativeDecoder.from_pretrained(target=target, dtype="float32")
    writer = SelfPrompts(dec, dec.tokenizer, seed=3, max_tokens=20)
    four = writer.take(0, 4)
    assert writer.take(2, 2) == four[2:] and len({tuple(p) for p in four}) == 4
    assert all(p[0] == dec.tokenizer.bos_token_id and 1 not in p and len(p) <= 20 for p in four)
    assert SelfPrompts(dec, dec.tokenizer, seed=4, max_tokens=20).take(0, 4) != four
    out = distill(target, tmp_path / "data", prompts="self", data_only=True, **{**TINY, "max_prompts": 16})
    summary = json.loads((out / "distill.json").read_text())
    assert summary["prompts"] == "self" and summary["data"]["train_prompts"] == 16


def test_self_written_chat_prompts_start_where_a_users_text_begins(tiny_target):
    """A chat target is prompted with its template up to the user's text; what it writes until
    its end of turn becomes one user turn, rendered with the generation prompt."""
    from treespec.distill.prompts import SelfPrompts

    target, _ = tiny_target
    dec = SpeculativeDecoder.from_pretrained(target=target, dtype="float32")
    tok = copy.deepcopy(dec.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<bos> w2 {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}<bos> w3 {% endif %}"
    )
    writer = SelfPrompts(dec, tok, seed=0, max_tokens=40)
    assert writer.prefix == [0, 2]
    for p in writer.take(0, 3):
        assert p[:2] == [0, 2] and p[-2:] == [0, 3] and p[-3] == 1  # ... <eos> <bos> w3
