"""Planning: what a round costs, what a drafter's draft is expected to yield, the automatic tree
that follows from both (`TreeConfig()`), and each round's decision of whether and how deep to draft.

A round that drafts a shape of n nodes and depth d costs, in plain rounds, its forwards (the
verification of n nodes and the root, `t(n + 1) / t(1)`, and d draft forwards of c each), what
each node adds (its walk, a tree level's further draft rows) and a speculative round's fixed
cost (the draft's catch-up, both caches' bookkeeping); it yields, in expectation, Sequoia's
positional value of the shape (`treespec.sequoia`): 1 + the sum over its nodes of the product
of the acceptance a[k] of each rank k on the node's path. Plain decoding costs 1 and yields 1.
The automatic tree is the shape with the most expected tokens per unit of cost, and no
speculation where none is expected to beat plain decoding by `PLAN_MARGIN`.

    costs.py       `Costs`: t(n)/t(1) of the target for n = 1 .. AUTO_MAX_NODES + 1, c and the
                   per-node and per-round costs; `measure_costs` times them from the runners
    cache.py       `CostCache`: measured costs kept on disk (under $TREESPEC_CACHE), once per
                   machine and model settings (`files_key`), and in memory
    acceptance.py  the drafter's positional acceptance a[k] (`AcceptanceCounts`; rank 0's by the
                   level of the node, `treespec.sequoia.by_level`) at temperature 0 and above:
                   shipped beside a draft (`write_acceptance`, `load_acceptance`), else what
                   earlier processes' requests measured, else `PRIOR`; i.i.d. trees level by
                   level (`IidLevels`); fixed for a decoder's life, so that a batch's outputs
                   equal each request's alone
    planner.py     `Planner.plan`: the Sequoia-optimal shape for that acceptance and these costs
                   (chains and trees of every width compete; `optimal_shape`), at T > 0 also the
                   measured i.i.d. trees, or plain decoding; `planner_for` makes a decoder's
    policy.py      `RoundPolicy`: each round, each request's draft depth (0: plain), composing
                   the load (`speculate_max_live`, `GoodputSwitch`), the request's own policy
                   (`DepthPolicy`, `AutoDepth` for a planned tree) and the node cap
                   (`shared_tree_nodes`)

Decisions follow committed outcomes only: given the same costs an output is reproducible from
its seed, and lossless (the depth of a round never depends on its own draws).
"""

from .acceptance import (
    ACCEPTANCE_FILE,
    PRIOR,
    AcceptanceCounts,
    IidLevels,
    load_acceptance,
    measure_acceptance,
    measure_iid_levels,
    temperature_class,
    write_acceptance,
)
from .cache import COSTS, CostCache, files_key, model_file
from .costs import Costs, measure_costs
from .planner import PLAN_MARGIN, Plan, Planner, planner_for
from .policy import AutoDepth, DepthPolicy, GoodputSwitch, RoundPolicy, depth_policy

__all__ = [
    "ACCEPTANCE_FILE",
    "COSTS",
    "PLAN_MARGIN",
    "PRIOR",
    "AcceptanceCounts",
    "AutoDepth",
    "CostCache",
    "Costs",
    "DepthPolicy",
    "GoodputSwitch",
    "IidLevels",
    "Plan",
    "Planner",
    "RoundPolicy",
    "depth_policy",
    "files_key",
    "load_acceptance",
    "measure_acceptance",
    "measure_costs",
    "measure_iid_levels",
    "model_file",
    "planner_for",
    "temperature_class",
    "write_acceptance",
]
