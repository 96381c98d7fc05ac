"""The native forward as inductor graphs (`NativeRunner(compile=True)`): `CompiledForward`.

`ForwardGraph` is the one-lane forward with logits written as a module for inductor (weights
as buffers, frozen into the graph); `CompiledForward` compiles one graph per small feed size
and one for longer feeds, in process (`torch.compile`) or ahead of time into a `GraphStore`
(aot.py), and answers None for what the graphs do not serve, which then runs eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .. import kernels
from ..attention import graph_lane_attention
from ..base import Feed, Scores, causal_visible
from ..kernels.q4q8 import op_name
from ..linear import Int4Projection, Product, Q4Q8Projection, QuantizedProjection, int4_product, int8_product
from .aot import GraphStore, model_digest
from .kv import KVPool
from .model import Layer, decoder_stack, rms_norm, rope_rows

if TYPE_CHECKING:
    from .runner import NativeRunner

COMPILE_MAX_TOKENS = 64  # feeds of up to this many tokens run through the compiled graphs (compile=True)
COMPILE_STATIC_MAX = 8  # feeds of 1..this many tokens get a graph of their own size (tuned products)

log = logging.getLogger(__name__)


def compile_unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `NativeRunner(compile=True)` cannot compile here, or None."""
    if device.type != "cpu":
        return f"compiled forwards are built for CPU only, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"compiled forwards run float32 and bfloat16 only, not {dtype}"
    return None


def resolve_compile(
    compile: bool | str, device: torch.device, dtype: torch.dtype, quantize: str | None, tp=None
) -> bool | str:
    """What a runner's `compile` comes to here: True (a warning and False where it cannot
    compile), False, or "auto": graphs loaded from the store where it holds them
    (`compiled_forward`), for quantized weights on a CPU, one process a model; False elsewhere
    (float weights choose their eager layout when they load, before the store is asked)."""
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', not {compile!r}")
    reason = compile_unsupported_reason(device, dtype) if compile else None
    if compile == "auto":
        return "auto" if reason is None and quantize is not None and tp is None else False
    if reason:
        warnings.warn(f"treespec: compile=True ignored, {reason}", stacklevel=4)
        return False
    if compile and device.type == "cpu":  # the one-time step builds the C++ kernels too, before the
        kernels.compiled()  # weights load: its graphs and later runs use them (`kernels.built`)
    return compile


def compiled_forward(
    runner, compile: bool | str, store: GraphStore | None, config: dict | None = None
) -> CompiledForward | None:
    """`runner`'s forwards with logits as `compile` (`resolve_compile`'s) asks: True, compiled
    where `store` lacks them; "auto", the graphs `store` holds if a one-token step's is among
    them (nothing is ever compiled; `load_stored` loads them), else None: the eager forward.
    `config`: `CompiledForward`'s."""
    if not compile:
        return None
    forward = CompiledForward(runner, config, store, build=compile is True)
    return forward if forward.build or forward.stored() else None


def add_tensor(module: torch.nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """`tensor` as `module`'s buffer `name`; a missing one (no bias, no scales) as a plain None,
    which torch.export takes where it refuses None buffers."""
    if tensor is None:
        setattr(module, name, None)
    else:
        module.register_buffer(name, tensor)


class GraphProduct(torch.nn.Module):
    """A projection (`linear.Product`) as graph buffers: its weight as its product reads it
    (float; int8 with a scale per row, plain or in the tiles of `kernels.bf16`'s q8bf16_linear;
    int4 packed, with scales and offsets per group, or in the tiles of q4bf16_linear; q4q8 in
    the kernel's tiles, `q4q8_linear` or `q8q8_linear`) and its bias. Called as the projection
    is: [T, in] -> [T, out]."""

    def __init__(self, projection: Product):
        super().__init__()
        if isinstance(projection, QuantizedProjection) and projection.tiles is not None:
            self.kind, weight, scales = "q8bf16", projection.tiles, None
            self.out_features, self.float_out = projection.out_features, projection.float_out
        elif isinstance(projection, QuantizedProjection):
            self.kind, weight, scales = "int8", projection.weight_int8, projection.scales
        elif isinstance(projection, Int4Projection) and projection.tiles is not None:
            self.kind, weight, scales = "q4bf16", projection.tiles, None
            self.out_features = projection.out_features
        elif isinstance(projection, Int4Projection):
            self.kind, weight, scales = "int4", projection.packed, projection.scales_and_zeros
        elif isinstance(projection, Q4Q8Projection):
            self.kind, weight, scales = "q4q8", projection.packed.data, None
            self.out_features, self.op = projection.out_features, op_name(projection.packed)
        else:
            self.kind, weight, scales = "float", projection.weight, None
        self.register_buffer("weight", weight)
        add_tensor(self, "scales", scales)
        add_tensor(self, "bias", projection.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "float":
            return F.linear(x, self.weight, self.bias)
        if self.kind == "q4q8":  # the custom op (its fake gives inductor the shapes); bias inside
            y = getattr(torch.ops.treespec, self.op)(x, self.weight, self.bias, self.out_features, -1)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if self.kind == "q8bf16":  # integer tiles x bf16 (`kernels.bf16`); bias inside
            n, f32 = self.out_features, self.float_out
            return torch.ops.treespec.q8bf16_linear(x, self.weight, self.bias, n, f32)
        if self.kind == "q4bf16":
            return torch.ops.treespec.q4bf16_linear(x, self.weight, self.bias, self.out_features)
        if self.kind == "int8":
            y = int8_product(x, self.weight, self.scales)
        else:
            y = int4_product(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias


class GraphLayer(torch.nn.Module):
    """A decoder `Layer` as graph buffers: its norms, and its projections as `GraphProduct`s."""

    def __init__(self, layer: Layer):
        super().__init__()
        self.register_buffer("attn_norm", layer.attn_norm)
        self.register_buffer("mlp_norm", layer.mlp_norm)
        self.qkv, self.o = GraphProduct(layer.qkv), GraphProduct(layer.o)
        self.gate_up, self.down = GraphProduct(layer.gate_up), GraphProduct(layer.down)

    def layer(self) -> Layer:
        """The layer its products read from the buffers (read as attributes: inductor freezes them)."""
        return Layer(self.attn_norm, self.qkv, self.o, self.mlp_norm, self.gate_up, self.down)


class ForwardGraph(torch.nn.Module):
    """The one-lane forward with logits, written for inductor: the weights are buffers (frozen
    into the graph as constants); the fed tokens, their positions and cache slots, the attention
    pattern, the RoPE tables and the KV pool (written in place) are inputs. The math is the
    eager forward's, layer for layer.

    Subclassing contract (a runner's `forward_graph()` returns its own, as `head.HeadRunner`
    does): `__init__(runner)` calls this one, which reads the runner's `shape`, `taps`, `tp`,
    `embed`, `norm`, `lm_head` and `layers`, then registers what else its forward reads
    (`add_tensor`, `GraphProduct`). `inputs(feed, slots, mask, pool)` gives `forward`'s
    inputs: `FED` tensors per fed token ([n, ...] each, the mask [n, span] last of them), then
    the pool's cos and sin tables ([cap, D]) and its cache `kv` ([L, 2, 1, Hkv, cap, D]), the
    sizes `CompiledForward` lets vary. `forward(*inputs)` returns the logits [n, V] and the
    features [n, F] (or None). `digest()` covers every buffer and `shape` and `taps`."""

    FED = 4  # the inputs per fed token (the attention mask last), then the pool's tables and cache

    def __init__(self, runner: NativeRunner):
        super().__init__()
        self.shape, self.taps, self.tp = runner.shape, runner.taps, runner.tp
        self.exact_rows = runner.exact_rows  # attention by `row_attention` (`attention.exact_rows`)
        self.register_buffer("embed", runner.embed)
        self.register_buffer("norm", runner.norm)
        self.lm_head = GraphProduct(runner.lm_head)
        self.layers = torch.nn.ModuleList(GraphLayer(layer) for layer in runner.layers)

    def layer(self, i: int) -> Layer:
        """Layer i, its products reading the buffers."""
        return self.layers[i].layer()

    @staticmethod
    def inputs(feed: Feed, slots: torch.Tensor, mask: torch.Tensor, pool: KVPool) -> tuple:
        """`forward`'s inputs for `feed`, written to `slots` under `mask`."""
        return (feed.tokens, feed.positions, slots, mask, pool.cos, pool.sin_signed, pool.kv)

    def forward(self, tokens, positions, slots, mask, cos_table, sin_table, kv):
        s = self.shape
        cos, sin = rope_rows(cos_table, sin_table, positions, s)  # [T, Hq+2Hkv, D] each
        layers = (self.layer(i) for i in range(s.layers))
        attend = lambda i, qkv: graph_lane_attention(kv, i, qkv, slots, mask, s.heads, self.exact_rows)  # noqa: E731 - [T, Hq*D]
        reduce = None if self.tp is None else self.tp.reduce
        x, features = decoder_stack(
            F.embedding(tokens, self.embed), layers, attend, cos, sin, s, self.taps, reduce
        )
        return self.lm_head(rms_norm(x, self.norm, s.eps)), features  # [T, V], [T, F]


@contextlib.contextmanager
def _quiet_compiler():
    """Inductor's autotuner warns of a deprecation inside torch (TypedStorage): not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def _two_rows(inputs: tuple, fed: int) -> tuple:
    """A one-token graph's inputs as two tokens' (its first `fed` inputs, the mask last among
    them, are per fed token), to export a graph for any number of tokens from: export traces
    them as fakes, so only their sizes matter, and nothing is computed or written."""
    *rows, mask = inputs[:fed]
    mask = torch.ones(2, mask.shape[1] + 1, dtype=mask.dtype, device=mask.device)  # [2, span + 1]
    return (*(torch.cat([t, t]) for t in rows), mask, *inputs[fed:])


def _mask(feed: Feed, S: int, device: torch.device) -> torch.Tensor:
    """The attention pattern [n, S + n] of `feed` after S cached slots, as a new tensor (made
    here as every mask is: a graph checks how its inputs were made)."""
    n = feed.tokens.shape[0]
    if feed.visible is not None:
        return feed.visible.clone()
    if n == 1:
        return torch.ones(1, S + 1, dtype=torch.bool, device=device)
    return causal_visible(n, S, device)


class CompiledForward:
    """A lane's forwards that need logits, of 1 to COMPILE_MAX_TOKENS tokens, as inductor graphs.

    Graphs compiled on first use: one per feed size from 1 to `static_max` tokens (the decode
    step; with float32 or int8 weights also a chain's verification and small trees, each with
    products tuned for its row count) and one for larger feeds up to COMPILE_MAX_TOKENS (the
    row count dynamic; with int4 or q4q8 weights, where the graph comes from the store, that one
    graph serves every feed: `static_max` 0); all take the attended span and the cache capacity
    as dynamic sizes, so none recompiles as the sequence or the cache grows. Which products each
    graph gets depends on the weights (`products`). Inductor freezes the weights into the
    graphs, packs them for the products it picked and fuses the norms, RoPE, SiLU gate and
    residual adds into a few C++ kernels.
    Attention is SDPA over the lane's cache row under an explicit mask
    (`attention.graph_lane_attention`). The math is the eager forward's; fused kernels keep
    float32 intermediates where eager rounds bf16 after each op, so bf16 logits differ in the
    last bits, as any two kernels for one op may (float32 agrees with HF to 1e-4,
    tests/test_native.py). What the graphs do not serve runs eagerly: prefills (no logits),
    longer feeds, lanes of a pool of several rows, a first token with an empty cache.

    With a `store` (`aot.GraphStore`, what NativeRunner(compile=True) gives but under tensor
    parallel), each graph is compiled ahead of time once for this machine and model and kept on
    disk, and a later process loads it instead of tracing and capturing it again. Without one,
    or where compiling ahead of time fails (reported once; the store remembers), the graph is
    compiled in process by `torch.compile`. A graph that fails to compile at all (no C++
    compiler, an unsupported torch) is reported once and not tried again; the eager forward
    takes over. Measurements: docs/performance.md.
    """

    # inductor settings, patched in around the call that compiles a graph (its first): freezing is read
    # outside what torch.compile(options=...) patches, and setting it process-wide would change
    # every other torch.compile of the process. AUTOTUNED: max-autotune picks, per product,
    # inductor's C++ GEMM template or the library's kernel; PACKED: the library's products
    # (oneDNN's packed ones for float weights), no autotuning.
    # autotuning reports nothing on stderr (its tables would bury treespec's progress lines)
    AUTOTUNED = {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": "CPP,ATEN",
        "autotune_num_choices_displayed": 0,
        "max_autotune_report_choices_stats": False,
    }
    PACKED = {"freezing": True, "max_autotune": False}
    # TEMPLATES: inductor's C++ GEMM template for every product and no timing. Where max-autotune
    # picks that template anyway (int4, at every row count), timing the choices only costs
    # compile time. A product the template cannot take has no choice left under it; such a
    # graph is compiled under AUTOTUNED instead (`candidates`).
    TEMPLATES = {**AUTOTUNED, "max_autotune_gemm_backends": "CPP"}
    # dynamo: a size seen twice must not turn dynamic by itself (each static size keeps its
    # graph), and there is room for every static size plus the dynamic graph
    DYNAMO = {"automatic_dynamic_shapes": False, "recompile_limit": COMPILE_STATIC_MAX + 4}

    def __init__(
        self,
        runner: NativeRunner,
        config: dict | None = None,
        store: GraphStore | None = None,
        build: bool = True,
    ):
        """`config`: inductor settings for every graph instead of AUTOTUNED / PACKED (tests use
        cheap ones). `store`: where graphs are kept across processes as AOTInductor packages
        (`aot.GraphStore`); None: each process compiles its own in process (`torch.compile`).
        `build=False`: only load graphs from `store`; a feed whose graph is not there runs
        eagerly, and nothing is compiled (`compile="auto"`)."""
        self.module = runner.forward_graph().eval()
        self._graph: Callable | None = None  # `graph`, made on first use
        self.custom_config = config
        static, dynamic, self.static_max = self.products(runner.quantize, runner.dtype)
        if config is not None:
            static = dynamic = config
        self.config = {"static": dict(static), "dynamic": dict(dynamic)}
        self.compiled: set[int | str] = set()  # graphs compiled: static feed sizes, "dynamic"
        self.build, self.unbuilt = build, set()  # unbuilt: graphs not in the store (build=False)
        self.failed = False
        self.store, self.model = store, None  # model: its digest, once a package is sought
        self.packages: dict[int | str, Callable] = {}  # graphs loaded from `store`

    @property
    def graph(self) -> Callable:
        """The forward under `torch.compile`, made when a graph is first compiled in process
        (importing dynamo takes ~2 s: a process that loads its graphs from the store skips it)."""
        if self._graph is None:
            self._graph = self._own_compiled_forward(self.module)
        return self._graph

    @graph.setter
    def graph(self, forward: Callable) -> None:
        self._graph = forward

    @staticmethod
    def _own_compiled_forward(module: ForwardGraph) -> Callable:
        """`module.forward` under `torch.compile`, as a code object of its own: dynamo keeps
        compiled graphs, and counts its recompile limit, per code object, so this keeps one
        runner's graphs apart from every other runner's (a target and its draft, or two dtypes,
        would share one cache and exhaust the limit)."""
        forward = type(module).forward
        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__)
        # its module's buffers are the frozen weights, never reassigned: dynamo need not guard
        # them; inputs keep their guards
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        return torch.compile(
            types.MethodType(own, module),
            fullgraph=True,
            options=None if skip is None else {"guard_filter_fn": skip},
        )

    @classmethod
    def products(cls, quantize: str | None, dtype: torch.dtype) -> tuple[dict, dict, int]:
        """(the static graphs' settings, the dynamic graph's, the largest feed with a graph of
        its own) for weights in `quantize` computing in `dtype`; each choice the faster inside
        the model (docs/performance.md, "Which products a compiled graph gets"). Int4:
        inductor's micro-kernel at every row count (tuned at one, it holds at the others), so
        one dynamic graph for every feed, taking it untimed (TEMPLATES). q4q8: the kernel's
        products at every row count, in one dynamic graph for every feed too (two graphs fuse
        their bf16 steps apart, and a tree node would not score as its path alone). bf16
        weights: oneDNN's packed products, so nothing to tune per size. float32 and int8: a
        tuned graph per small feed size, and oneDNN's / torch's products for longer feeds (a
        float template tuned at one row count loses at others)."""
        if quantize == "int4":
            return cls.TEMPLATES, cls.TEMPLATES, 0
        if quantize == "q4q8":  # the products are the kernel's at every row count: nothing to tune
            return cls.PACKED, cls.PACKED, 0
        if quantize is None and dtype == torch.bfloat16:
            return cls.PACKED, cls.PACKED, 1
        return cls.AUTOTUNED, cls.PACKED, COMPILE_STATIC_MAX

    def __call__(self, runner: NativeRunner, feed: Feed, S: int) -> Scores | None:
        """The `Scores` of `feed` after the S slots `runner` holds (its cache written), or None
        where the graphs do not serve it."""
        n, pool = feed.tokens.shape[0], runner.pool
        if self.failed or pool.rows != 1 or S < 1 or n > COMPILE_MAX_TOKENS:
            return None
        # capacity > span: the first call of a graph fixes which dynamic sizes are one symbol,
        # and a span equal to the capacity there would tie the two for good
        pool.fit(S + n + 1)
        slots = torch.arange(S, S + n, device=runner.device)
        inputs = self.module.inputs(feed, slots, _mask(feed, S, runner.device), pool)
        # static_max 0: the dynamic graph serves every feed where it comes from the store; in
        # process, dynamo keeps no dimension of size 1 dynamic, so one token gets a graph of its own
        static = n <= self.static_max or (n == 1 and 1 in self.compiled)
        graph = n if static else "dynamic"
        if graph in self.unbuilt:
            return None
        try:
            if graph in self.compiled:
                # compiled: the dynamic sizes and settings are read only while compiling
                return Scores(*(self.packages[graph] if graph in self.packages else self.graph)(*inputs))
            return self._first_call(graph, inputs, pool)
        except Exception as e:  # noqa: BLE001 - any compile failure means: run eagerly from now on
            self.failed = True
            warnings.warn(
                f"treespec: the compiled forward failed ({type(e).__name__}: {e}); running eagerly",
                stacklevel=2,
            )
            return None

    def _first_call(self, graph: int | str, inputs: tuple, pool: KVPool) -> Scores:
        """Compile graph `graph` (a feed size, or "dynamic") on its first `inputs`: from the
        store where there is one and it serves, else in process; the `Scores` of that call."""
        static = graph != "dynamic"
        candidates = self.candidates(self.config["static" if static else "dynamic"])
        what = self._serves(graph)
        package = self._package(graph, inputs, candidates, what) if self.store is not None else None
        if package is not None:
            self.packages[graph] = package
            self.compiled.add(graph)
            return Scores(*package(*inputs))
        if not self.build:
            self.unbuilt.add(graph)
            return None
        n = inputs[0].shape[0]
        if n == 1 and not static:  # in process: the one-token graph (see __call__)
            static, graph, what = True, 1, "1 tokens"
        if not static:
            for t in inputs[: self.module.FED]:
                torch._dynamo.mark_dynamic(t, 0, min=max(self.static_max, 1) + 1, max=COMPILE_MAX_TOKENS)
        torch._dynamo.mark_dynamic(inputs[self.module.FED - 1], 1)  # the mask's span
        for t, dim in ((pool.kv, 4), (pool.cos, 0), (pool.sin_signed, 0)):
            torch._dynamo.mark_dynamic(t, dim)
        log.info("compiling the forward for %s (once per process; seconds to minutes)", what)
        with (
            torch._inductor.config.patch(candidates[-1]),  # the settings every product takes
            torch._dynamo.config.patch(
                {k: v for k, v in self.DYNAMO.items() if hasattr(torch._dynamo.config, k)}
            ),
            _quiet_compiler(),
        ):
            scores = Scores(*self.graph(*inputs))
        self.compiled.add(graph)
        return scores

    @classmethod
    def candidates(cls, settings: dict) -> list[dict]:
        """The settings to compile a graph under, in order: `settings`, then AUTOTUNED where
        `settings` leaves a product no kernel but the C++ template (TEMPLATES)."""
        templates_only = settings.get("max_autotune_gemm_backends") == "CPP"
        return [settings, cls.AUTOTUNED] if templates_only else [settings]

    def _serves(self, graph: int | str) -> str:
        """What graph `graph` serves, for the log."""
        return (
            f"{graph} tokens" if graph != "dynamic" else "longer feeds" if self.static_max else "every feed"
        )

    def _stored_keys(self, graph: int | str) -> list[str]:
        """The store's keys of graph `graph`, under each of the settings it would compile under."""
        settings = self.config["dynamic" if graph == "dynamic" else "static"]
        return [self.store.key(self.digest(), graph, s) for s in self.candidates(settings)]

    def stored(self) -> bool:
        """Whether the store holds the graph of a one-token step (nothing is loaded)."""
        if self.store is None or self.store.empty():  # no weights' digest to compute
            return False
        keys = self._stored_keys(1 if self.static_max else "dynamic")
        return any(self.store.path(k).is_file() and not self.store.refused(k) for k in keys)

    def load_stored(self) -> None:
        """Load every graph of these forwards that the store holds and is not loaded yet (so
        that the first tokens do not wait for them); nothing is compiled."""
        if self.store is None:
            return
        for graph in (*range(1, self.static_max + 1), "dynamic"):
            for key in [] if graph in self.compiled else self._stored_keys(graph):
                package = None if self.store.refused(key) else self.store.load(key)
                if package is not None:
                    log.info(
                        "loaded the compiled forward for %s from %s", self._serves(graph), self.store.root
                    )
                    self.packages[graph] = package
                    self.compiled.add(graph)
                    break

    def digest(self) -> str:
        """What these graphs compute (`aot.model_digest`: weights, shape, taps), computed once."""
        if self.model is None:
            kinds = sorted({m.kind for m in self.module.modules() if isinstance(m, GraphProduct)})
            m = self.module
            self.model = model_digest(m, shape=m.shape, taps=m.taps, products=kinds, exact_rows=m.exact_rows)
        return self.model

    def _package(self, graph: int | str, inputs: tuple, candidates: list[dict], what: str) -> Callable | None:
        """Graph `graph` (`what` it serves, for the log) from the store, under the first of the
        inductor settings `candidates` it compiles under: loaded, or compiled ahead of time once
        for this machine and model and kept there; None where it cannot be (the graph is then
        compiled in process, as without a store, and later processes do not try again)."""
        failure = None
        for settings in candidates:
            key = self.store.key(self.digest(), graph, settings)
            if self.store.refused(key):
                continue
            package = self.store.load(key)
            if package is not None:
                log.info("loaded the compiled forward for %s from %s", what, self.store.root)
                return package
            if not self.build:
                continue
            try:
                return self._build(key, graph, inputs, settings, what)
            except Exception as e:  # noqa: BLE001 - the next settings, then the in-process compiler
                self.store.refuse(key, e)
                failure = e
        if failure is not None:
            warnings.warn(
                f"treespec: compiling the forward ahead of time failed ({type(failure).__name__}: "
                f"{failure}); compiling it in this process instead",
                stacklevel=4,
            )
        return None

    def _build(self, key: str, graph: int | str, inputs: tuple, settings: dict, what: str) -> Callable:
        """Compile graph `graph` ahead of time under `settings` into the store, as `key`."""
        # the sizes free in every graph: the attended span, the RoPE tables' rows, the cache's
        # capacity; and in the dynamic graph the fed tokens
        Dim = torch.export.Dim  # noqa: N806 - torch's name
        span, rope, cap = Dim("span", min=2), Dim("rope", min=2), Dim("cap", min=3)
        rows = {0: Dim("n", min=self.static_max + 1, max=COMPILE_MAX_TOKENS)} if graph == "dynamic" else None
        fed = self.module.FED
        dims = ((rows,) * (fed - 1)) + ({1: span, **(rows or {})}, {0: rope}, {0: rope}, {4: cap})
        if rows is not None and inputs[0].shape[0] == 1:
            inputs = _two_rows(inputs, fed)  # export keeps no dimension of size 1 dynamic
        log.info(
            "compiling the forward for %s ahead of time (once for this machine and model, kept in %s; "
            "about a minute)", what, self.store.root,
        )  # fmt: skip
        with _quiet_compiler():
            return self.store.build(key, self.module, inputs, dims, settings)
