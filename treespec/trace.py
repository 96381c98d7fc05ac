"""Round-by-round traces: what was drafted, what each proposal's coin was, what came out.

`generate(..., trace=True)` records one `RoundTrace` per round in `out.trace`: the draft tree,
every proposal with its target probability p(x), draft probability q(x) (the distribution it
was tried with: q_k for the k-th draw without replacement, 1 for a deterministic proposal),
its coin and outcome, the token that ended the round and the distribution it came from, and
the depth decision. Verification records into a `WalkTrace` only when asked, so a run without
tracing pays nothing (no extra host transfers).

The coin of a proposal is the probability of the coin the rule flipped for it:

    token      min(1, r(x)/q(x)) with the running residual r, given every earlier proposal
               at that node was rejected
    block,     the probability of stopping at the proposal's node, given every node visited
    traversal  before it did not stop (block: leaf back to root; traversal: post-order)
    greedy     1 if x is the target's argmax at the parent, else 0

`render_round` draws a round as text (coloured on a terminal, plain otherwise), `plot_round`
as a matplotlib figure (optional import) and `round_to_json` as JSON (the server's page).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .proposal import DepthStep, Outcome, ProposalTrace
from .tree import TokenTree


@dataclass(frozen=True)
class RoundTrace:
    index: int  # 0-based round number
    tree: TokenTree  # the draft tree (node 0: the last committed token)
    rule: str  # verification rule
    proposals: tuple[ProposalTrace, ...]
    path: tuple[int, ...]  # accepted nodes, root first
    token: int  # the correction or bonus token that ended the round
    kind: str  # "correction" or "bonus"
    source: str  # where that token's distribution came from
    emitted: tuple[int, ...]  # tokens this round added to the output (after length / stop cuts)
    depth_step: DepthStep | None  # the depth decision (None: plain decoding or a zero-depth round)


MARK = {"accepted": "✓", "rejected": "✗", "untried": "·"}
COLOUR = {
    "accepted": "\033[32m",
    "rejected": "\033[31m",
    "untried": "\033[2m",
    "correction": "\033[33m",
    "bonus": "\033[36m",
}
RESET = "\033[0m"


def render_round(round_: RoundTrace, decode: Callable[[int], str] = str, colour: bool = False) -> str:
    """A round as an indented tree: every proposal with its mark (✓ accepted, ✗ rejected,
    · untried), p, q and coin (a node carrying several i.i.d. draws of one token shows one
    mark and coin per draw); then the final token and its source. `decode` turns a token id
    into text; `colour` adds ANSI colours (use `treespec.cli.common.use_colour` to decide)."""
    paint = (lambda text, key: f"{COLOUR[key]}{text}{RESET}") if colour else (lambda text, key: text)
    tree = round_.tree
    by_node = proposals_by_node(round_)
    head = f"round {round_.index} ({round_.rule}"
    if round_.depth_step is not None:
        d = round_.depth_step
        entropy = (
            ""
            if d.entropy is None
            else f", entropy {d.entropy:.3f}{'' if d.from_drafter else ' (rejection rate)'}"
        )
        head += f", depth {d.depth}{entropy} -> next {d.next_depth}"
    lines = [head + ")", f"{decode(tree.tokens[0])!r}"]

    def walk(u: int, prefix: str) -> None:
        kids = tree.children(u)
        for i, c in enumerate(kids):
            last = i == len(kids) - 1
            pts = by_node.get(c, [])
            label = f"{decode(tree.tokens[c])!r}"
            if pts:
                marks = "".join(MARK[pt.outcome] for pt in pts)
                coins = ",".join(f"{pt.coin:.3g}" for pt in pts)
                label = (
                    paint(f"{marks} {label}", node_outcome(pts))
                    + f"  p={pts[0].p:.3g} q={pts[0].q:.3g} coin={coins}"
                )
            lines.append(f"{prefix}{'└─ ' if last else '├─ '}{label}")
            walk(c, prefix + ("   " if last else "│  "))

    walk(0, "")
    lines.append(
        paint(f"{round_.kind} {decode(round_.token)!r}", round_.kind)
        + f" from {round_.source}; emitted {len(round_.emitted)}"
    )
    return "\n".join(lines)


def proposals_by_node(round_: RoundTrace) -> dict[int, list[ProposalTrace]]:
    """Each node's proposals (several for i.i.d. draws of one token merged into one node)."""
    out: dict[int, list[ProposalTrace]] = {}
    for pt in round_.proposals:
        out.setdefault(pt.node, []).append(pt)
    return out


def node_outcome(proposals: list[ProposalTrace]) -> Outcome:
    """A node's outcome: accepted if any of its proposals was, else rejected if any was tried."""
    outcomes = {pt.outcome for pt in proposals}
    return "accepted" if "accepted" in outcomes else "rejected" if "rejected" in outcomes else "untried"


def round_to_json(round_: RoundTrace, decode: Callable[[int], str] = str) -> dict:
    """A round as plain JSON (what `treespec serve` streams with `"trace": true`): each node's
    text, parent, depth, outcome and its proposals' p, q and coin (node 0: the last committed
    token, outcome "root"), the accepted path, and the token that ended the round."""
    tree, by_node = round_.tree, proposals_by_node(round_)
    nodes = []
    for u, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        proposals = by_node.get(u, [])
        nodes.append(
            {
                "id": u,
                "parent": parent,
                "depth": tree.depths[u],
                "text": decode(token),
                "outcome": "root" if u == 0 else node_outcome(proposals) if proposals else "untried",
                "p": [pt.p for pt in proposals],
                "q": [pt.q for pt in proposals],
                "coin": [pt.coin for pt in proposals],
            }
        )
    return {
        "index": round_.index,
        "rule": round_.rule,
        "nodes": nodes,
        "path": list(round_.path),
        "final": {"text": decode(round_.token), "kind": round_.kind, "source": round_.source},
        "emitted": len(round_.emitted),
    }


def plot_round(round_: RoundTrace, decode: Callable[[int], str] = str, ax=None):
    """Draw one round's tree with matplotlib (optional dependency): accepted proposals green,
    rejected red, untried grey; edge labels are the coins. Returns the matplotlib Axes."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ValueError("plot_round needs matplotlib: pip install matplotlib") from e
    tree = round_.tree
    g = tree.to_networkx()
    by_node = proposals_by_node(round_)
    leaves: list[int] = []
    x: dict[int, float] = {}

    def place(u: int) -> float:  # leaves left to right, parents centred over their children
        kids = tree.children(u)
        if not kids:
            leaves.append(u)
            x[u] = float(len(leaves))
        else:
            x[u] = sum(place(c) for c in kids) / len(kids)
        return x[u]

    place(0)
    pos = {u: (x[u], -tree.depths[u]) for u in g.nodes}
    colours = {"accepted": "tab:green", "rejected": "tab:red", "untried": "lightgrey"}
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4, len(leaves) * 1.2), 1.5 + 1.2 * tree.max_depth))
    for a, b in g.edges:
        ax.plot([pos[a][0], pos[b][0]], [pos[a][1], pos[b][1]], color="grey", zorder=1)
        ax.annotate(
            ",".join(f"{pt.coin:.2f}" for pt in by_node.get(b, [])),
            ((pos[a][0] + pos[b][0]) / 2, (pos[a][1] + pos[b][1]) / 2),
            fontsize=7,
        )
    for u in g.nodes:
        face = "white" if u == 0 else colours[node_outcome(by_node[u])] if u in by_node else "lightgrey"
        ax.scatter(*pos[u], s=600, color=face, edgecolors="black", zorder=2)
        ax.annotate(decode(tree.tokens[u]), pos[u], ha="center", va="center", fontsize=8, zorder=3)
    ax.set_title(
        f"round {round_.index}: {round_.kind} {decode(round_.token)!r} from {round_.source}", fontsize=9
    )
    ax.axis("off")
    return ax
