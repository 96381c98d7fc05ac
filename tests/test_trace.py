"""Round-by-round traces: reproducible, consistent with the output, and recording the very
p and q the walk used."""

from __future__ import annotations

import pytest

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.cli import main
from treespec.sampling import probs
from treespec.trace import RoundTrace, render_round

from .toy import TableRunner, pair

PROMPT = [1, 0, 2]
CASES = {  # name: (tree, sampling, verification)
    "iid-token": (TreeConfig(2, 2), SamplingConfig(temperature=1.0), "token"),
    "beam-traversal": (
        TreeConfig(2, 2, "without_replacement", adaptive="entropy", depth_min=1, depth_max=6, ema_beta=0.0),
        SamplingConfig(temperature=0.9),
        "traversal",
    ),
    "chain-block": (
        TreeConfig(1, 3, adaptive="hf", depth_min=1, depth_max=4),
        SamplingConfig(temperature=1.0, top_k=2),
        "block",
    ),
    "greedy": (TreeConfig(2, 3, "topk"), SamplingConfig(temperature=0), None),
    "penalised": (TreeConfig(3, 2), SamplingConfig(temperature=1.0, repetition_penalty=1.5), "token"),
}


def run(case: str, seed: int = 0, trace: bool = True):
    target, draft = pair()
    dec = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    tree, sampling, verification = CASES[case]
    return dec.generate(
        PROMPT,
        12,
        tree=tree,
        sampling=sampling,
        seed=seed,
        ignore_eos=True,
        verification=verification,
        trace=trace,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_trace_is_reproducible_and_agrees_with_the_output(case):
    out = run(case)
    assert out.trace == run(case).trace  # same seed, same trace
    assert run(case, trace=False).trace is None
    assert [t for r in out.trace for t in r.emitted] == out.token_ids
    for r in out.trace:
        assert isinstance(r, RoundTrace) and r.path[0] == 0
        assert list(r.emitted) == [r.tree.tokens[n] for n in r.path[1:]] + [r.token]
        accepted = {pt.node for pt in r.proposals if pt.outcome == "accepted"}
        assert accepted == set(r.path[1:])
        recorded = {pt.node for pt in r.proposals}
        if r.rule == "token" or CASES[case][1].greedy:  # the proposals at every node the walk visited
            assert recorded == {c for u in r.path for c in r.tree.children(u)}
        else:  # block and traversal weigh every node
            assert recorded == set(range(1, len(r.tree)))
        assert r.kind == ("bonus" if r.tree.is_leaf(r.path[-1]) else "correction")
        assert r.depth_step is not None and r.depth_step.depth == r.tree.max_depth or len(r.tree) == 1
        assert render_round(r).startswith(f"round {r.index} (")
    if CASES[case][0].adaptive:
        assert (
            len({r.depth_step.depth for r in out.trace if r.depth_step is not None}) > 1
        )  # the depth moved, and the trace shows it


def test_trace_records_the_p_and_q_the_walk_used():
    """i.i.d. proposals: p(x) and q(x) recomputed from the tables at the proposal's context;
    the first proposal at a node has coin min(1, p/q)."""
    target, draft = pair()
    sampling = CASES["iid-token"][1]
    out = run("iid-token")
    context = list(PROMPT)
    for r in out.trace:
        first = set()
        for pt in r.proposals:
            ctx = tuple(context) + tuple(r.tree.tokens[n] for n in r.tree.path_to(pt.parent)[1:])
            assert pt.p == pytest.approx(float(probs(target.logits(ctx), sampling)[pt.token]), abs=1e-12)
            assert pt.q == pytest.approx(float(probs(draft.logits(ctx), sampling)[pt.token]), abs=1e-12)
            if pt.parent not in first:
                first.add(pt.parent)
                assert pt.coin == pytest.approx(min(1.0, pt.p / pt.q), abs=1e-12)
        context += list(r.emitted)


def test_cli_trace_is_plain_when_piped(capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert (
        main(
            [
                "generate",
                "def f(x):",
                "--max-new-tokens",
                "8",
                "--trace",
                "--width",
                "2",
                "--depth",
                "2",
                "--temperature",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "round 0 (" in out and "coin=" in out and " from " in out
    assert "\033[" not in out
    assert main(["generate", "def f(x):", "--max-new-tokens", "4", "--trace", "--color", "always"]) == 0
    assert "\033[" in capsys.readouterr().out


def test_plot_round_draws_a_round(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from treespec.trace import plot_round

    ax = plot_round(run("beam-traversal").trace[0])
    ax.figure.savefig(tmp_path / "round.png")
    assert (tmp_path / "round.png").stat().st_size > 0


def test_trace_must_be_a_bool():
    target, draft = pair()
    dec = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    with pytest.raises(ValueError, match="trace must be True or False"):
        dec.generate(PROMPT, 4, trace="yes")


@pytest.mark.parametrize("case", ["iid-token", "beam-traversal"])
def test_rounds_stream_to_on_round_and_as_json(case):
    """`on_round` gets every round as it ends (the server streams them to its page), and
    `round_to_json` keeps the tree, the accepted path and each node's p, q and coin."""
    import json

    from treespec.trace import node_outcome, proposals_by_node, round_to_json

    target, draft = pair()
    dec = SpeculativeDecoder(TableRunner(target), TableRunner(draft))
    tree, sampling, verification = CASES[case]
    eng, got = dec.engine(max_live=1), []
    rid = eng.add(PROMPT, 12, tree=tree, sampling=sampling, seed=0, ignore_eos=True,
                  verification=verification, trace=True, on_round=got.append)  # fmt: skip
    out = eng.run()[rid]
    assert got == list(out.trace)
    for r in got:
        drawn = json.loads(json.dumps(round_to_json(r, lambda t: f"<{t}>")))
        assert [n["parent"] for n in drawn["nodes"]] == list(r.tree.parents)
        assert [n["text"] for n in drawn["nodes"]] == [f"<{t}>" for t in r.tree.tokens]
        assert drawn["path"] == list(r.path) and drawn["emitted"] == len(r.emitted)
        by_node = proposals_by_node(r)
        for n in drawn["nodes"][1:]:
            assert n["p"] == [pt.p for pt in by_node.get(n["id"], [])]
            assert n["outcome"] == (node_outcome(by_node[n["id"]]) if n["id"] in by_node else "untried")
        assert all(drawn["nodes"][u]["outcome"] in ("root", "accepted") for u in r.path)
    with pytest.raises(ValueError, match="needs trace=True"):
        eng.add(PROMPT, 4, on_round=print)
