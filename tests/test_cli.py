"""The `treespec` command end to end on the bundled pair; user errors exit 2 in one line."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from treespec.cli import build_parser, main
from treespec.sequoia import TreeShape


def test_generate_streams_text(capsys):
    assert main(["generate", "def quicksort(xs):", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def quicksort(xs):") and len(out) > len("def quicksort(xs):") + 1


def test_generate_show_tree_colours_tokens_and_prints_stats(capsys):
    assert (
        main(
            [
                "generate",
                "import os\n",
                "--max-new-tokens",
                "24",
                "--show-tree",
                "--temperature",
                "0.8",
                "--top-p",
                "0.95",
                "--seed",
                "1",
                "--color",
                "always",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "\033[32m" in out or "\033[36m" in out  # accepted (green) or bonus (cyan) tokens
    assert "tokens/step" in out and "acceptance by depth" in out and "tokens/s" in out
    assert "acceptance rate" in out and "mean accepted length" in out
    assert "target weights: dense, computing in " in out  # a checkpoint without 4-bit blocks
    assert out.rstrip().count("eager forward") == 1  # dense weights: no kept graphs are sought


def test_compile_eager_and_auto_flags():
    """--compile (build the graphs), --eager (never run them), neither: compile="auto"; the
    server runs eagerly unless asked."""
    from treespec.serve.cli import add_arguments as serve_arguments

    parser = build_parser()
    assert parser.parse_args(["generate", "x"]).compile == "auto"
    assert parser.parse_args(["generate", "x", "--compile"]).compile is True
    assert parser.parse_args(["chat", "--eager"]).compile is False
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--compile", "--eager"])
    serve = argparse.ArgumentParser()
    serve_arguments(serve)
    assert serve.parse_args([]).compile is False and serve.parse_args(["--compile"]).compile is True


@pytest.mark.parametrize(
    "tty,no_color,colour", [(False, None, False), (True, "1", False), (True, None, True)]
)
def test_show_tree_colours_only_on_a_terminal_without_no_color(capsys, monkeypatch, tty, no_color, colour):
    import sys

    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty, raising=False)
    assert main(["generate", "import os\n", "--max-new-tokens", "8", "--show-tree"]) == 0
    out = capsys.readouterr().out
    assert ("\033[" in out) == colour
    assert "token sources: accepted" in out and "tokens/step" in out


def test_generate_stop_strings(capsys):
    prompt = "def quicksort(xs):"
    assert (
        main(["generate", prompt, "--max-new-tokens", "48", "--stop", "\\n", "--stop", "zzzz", "--show-tree"])
        == 0
    )
    out = capsys.readouterr().out
    generated = out[len(prompt) :].split("\ntoken sources")[0]
    assert (
        "(stop)" in out and generated.count("\n") <= 3
    )  # the stop "\n", maybe an overhang, the final newline
    assert main(["generate", prompt, "--max-new-tokens", "8", "--stop-id", "0", "--stop-id", "5"]) == 0


@pytest.mark.parametrize(
    "extra",
    [
        ["--drafter", "ngram"],
        ["--drafter", "merged"],
        ["--strategy", "dynamic", "--budget", "8"],
        ["--adaptive", "hf"],
        ["--depth", "2", "--adaptive", "entropy", "--plain-fallback"],
        ["--plain"],
    ],
)
def test_generate_options(capsys, extra):
    assert main(["generate", "class Foo:\n    def __init__(self):\n", "--max-new-tokens", "12", *extra]) == 0


def test_tiny_bench_writes_json(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    args = ["bench", "--n-prompts", "1", "--repeats", "1", "--max-new-tokens", "8", "--json", str(out_json)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    treespec_methods = {f"{m}[{b}]" for m in ("autoregressive", "linear", "tree") for b in ("native", "hf")}
    for method in {"hf", "hf-assisted"} | treespec_methods:
        assert method in printed
    data = json.loads(out_json.read_text())
    assert {m["method"] for m in data["methods"]} == {"hf", "hf-assisted"} | treespec_methods
    for backend in ("native", "hf"):
        assert data["cost"][backend]["c"] > 0
    for m in data["methods"]:
        if m["method"].startswith(("linear", "tree")):
            assert 0 < m["acceptance_rate"] <= 1 and m["mean_accepted_length"] > 0 and m["draft_forwards"] > 0


def test_bench_with_a_sequoia_shape(capsys, tmp_path):
    shape = tmp_path / "shape.json"
    TreeShape((-1, 0, 0, 1)).save(shape)
    args = [
        "bench",
        "--n-prompts",
        "1",
        "--repeats",
        "1",
        "--max-new-tokens",
        "6",
        "--shape",
        str(shape),
        "--methods",
        "linear,tree",
        "--backend",
        "native",
        "--json",
        str(tmp_path / "b.json"),
    ]
    assert main(args) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert {m["method"] for m in data["methods"]} == {"linear[native]", "tree[native]"}
    assert data["config"]["shape"] == str(shape)


def test_bench_batch_size(capsys, tmp_path):
    """--batch-size 3 over 2 prompts: one batch of 3 requests (prompts cycled); HF generate runs
    it left-padded, treespec as generate_batch; hf-assisted cannot batch and is skipped."""
    args = [
        "bench",
        "--n-prompts",
        "2",
        "--repeats",
        "1",
        "--max-new-tokens",
        "5",
        "--batch-size",
        "3",
        "--methods",
        "hf,hf-assisted,autoregressive,tree",
        "--backend",
        "native",
        "--json",
        str(tmp_path / "b.json"),
    ]
    assert main(args) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["config"]["batch_size"] == 3
    methods = {m["method"]: m for m in data["methods"]}
    assert set(methods) == {"hf", "autoregressive[native]", "tree[native]"}
    assert all(len(m["runs"]) == 1 and m["tokens_per_second"] > 0 for m in methods.values())
    assert methods["tree[native]"]["tokens_per_step"] >= 1


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["generate", "x", "--target", "/nonexistent", "--draft", "/nonexistent"],
            "no model at '/nonexistent'",
        ),
        (["generate", "x", "--width", "0"], "--width must be an integer >= 1"),
        (["generate", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["generate", "x", "--temperature", "-1"], "temperature must be"),
        (["generate", "x", "--target", "/nonexistent"], "--target needs --draft"),
        (["generate", "x", "--strategy", "sequoia"], "shape is required"),
        (["generate", "x", "--shape", "/nonexistent.json"], "cannot read a tree shape"),
        (["bench", "--prompts", "/nonexistent.json"], "cannot read prompts"),
        (
            ["bench", "--json", "/proc/treespec-bench.json"],
            "--json /proc/treespec-bench.json is not writable",
        ),
        (["bench", "--json", "/"], "is a directory"),
        (["bench", "--json", "/nonexistent/dir/b.json"], "directory /nonexistent/dir does not exist"),
        (["bench", "--device", "npu"], "unknown device 'npu'"),
        (["bench", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["bench", "--methods", "tree,medusa"], "--methods: unknown ['medusa']"),
        (["generate", "x", "--device", "npu"], "unknown device 'npu'"),
        (["generate", "x", "--seed", "-1"], "seed must be None or an integer in [0, 2**64)"),
        (["generate", "x", "--seed", str(2**64)], "seed must be None or an integer in [0, 2**64)"),
        (["generate", "x", "--width", "100000"], "the limit is 1024"),
        (["generate", "x", "--temperature", "1e-40"], "so small that logits / temperature overflows"),
        (
            ["generate", "x", "--target", "models/llama/3b", "--draft", "models/llama/1b"],
            "no model at 'models/llama/3b'",
        ),
    ],
)
def test_user_errors_are_one_line_with_exit_code_2(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("treespec: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "x", "--strategy", "nope"])
    assert e.value.code == 2


@pytest.mark.skipif(
    shutil.which("treespec") is None, reason="console script not installed (pip install -e .)"
)
def test_console_script(tmp_path):
    r = subprocess.run(
        ["treespec", "generate", "x", "--width", "-2"], capture_output=True, text=True, timeout=120
    )
    assert (
        r.returncode == 2 and r.stderr.strip().startswith("treespec: error:") and "Traceback" not in r.stderr
    )


def test_generate_with_penalties(capsys):
    args = ["generate", "x = x + x + x", "--max-new-tokens", "12", "--ignore-eos"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert (
        main(args + ["--repetition-penalty", "3", "--frequency-penalty", "0.5", "--presence-penalty", "0.5"])
        == 0
    )
    assert capsys.readouterr().out != plain  # greedy, so only the penalties can change it
    assert main(args + ["--repetition-penalty", "0"]) == 2
    assert "--repetition-penalty must be a finite number > 0" in capsys.readouterr().err


def test_run_bench_takes_token_id_prompts_without_a_tokenizer(target64, draft64):
    """What experiments/costs/shaped_bench.py relies on: random-weight models have no tokenizer, so
    the prompts are token ids (HF generate gets them left-padded, treespec as they are)."""
    from treespec import SamplingConfig, TreeConfig
    from treespec.bench.harness import run_bench
    from treespec.bench.results import result_table

    result = run_bench(
        target64,
        draft64,
        None,
        [[3, 4, 5, 6], [7, 8]],
        5,
        TreeConfig(2, 2),
        SamplingConfig(temperature=0),
        repeats=1,
        methods=("hf", "autoregressive", "tree"),
        backends=("native",),
    )
    methods = {m.method: m for m in result.methods}
    assert set(methods) == {"hf", "autoregressive[native]", "tree[native]"}
    assert (
        all(m.tokens_per_second > 0 for m in methods.values())
        and methods["tree[native]"].tokens_per_step >= 1
    )
    assert "tree[native]" in result_table(result) and "cost [native]" in result_table(result)
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
        run_bench(target64, draft64, None, ["text"], 5, TreeConfig(), SamplingConfig(), repeats=1)


def test_run_bench_warmup_decodes_untimed_first(target64, draft64, monkeypatch):
    """warmup=True: every treespec method decodes every prompt once before the timed runs
    (compiled graphs compile there), and those decodes are neither timed nor pooled."""
    from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
    from treespec.bench.harness import run_bench

    calls = []
    generate = SpeculativeDecoder.generate

    def counted(self, prompt, *args, **kwargs):
        calls.append(kwargs["seed"])
        return generate(self, prompt, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", counted)
    kw = dict(repeats=1, methods=("autoregressive", "tree"), backends=("native",))
    prompts, tree, greedy = [[3, 4, 5, 6], [7, 8]], TreeConfig(2, 2), SamplingConfig(temperature=0)
    cold = run_bench(target64, draft64, None, prompts, 5, tree, greedy, **kw)
    assert len(calls) == 4  # 2 methods x 2 prompts, timed
    warm = run_bench(target64, draft64, None, prompts, 5, tree, greedy, warmup=True, **kw)
    assert len(calls) == 4 + 8 and sorted(set(calls[4:8])) == [10**6, 10**6 + 1]  # warm-up seeds first
    for c, w in zip(cold.methods, warm.methods):
        assert len(w.runs) == len(c.runs) == 2
        assert w.tokens_per_step == c.tokens_per_step  # greedy: the same rounds, warm-up not pooled


def test_pairs_and_model_free_target(capsys):
    from treespec.zoo import pair

    target, _ = pair("pycode")
    assert (
        main(
            [
                "generate",
                "import os\n",
                "--target",
                str(target),
                "--drafter",
                "lookup",
                "--max-new-tokens",
                "6",
            ]
        )
        == 0
    )
    assert main(["generate", "x", "--target", str(target), "--max-new-tokens", "2"]) == 2
    assert "--target needs --draft" in capsys.readouterr().err
    assert main(["generate", "x", "--pair", "pycode", "--target", str(target)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["generate", "hello", "--chat", "--pair", "pycode", "--max-new-tokens", "2"]) == 2
    assert "chat template" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_is_one_line_not_a_traceback():
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "treespec", "generate", "x", "--max-new-tokens", "2"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert r.returncode == 1 and "cannot write the output" in r.stderr and "Traceback" not in r.stderr


def test_the_command_flushes_runs_exit_handlers_and_keeps_its_exit_code():
    script = (
        "import atexit, sys\n"
        "import treespec.cli as cli\n"
        "def main():\n"
        "    atexit.register(lambda: print('handler ran', file=sys.stderr))\n"
        "    print('unflushed output', end='')\n"
        "    return 3\n"
        "cli.main = main\n"
        "cli.console()\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (3, "unflushed output", "handler ran\n")


def test_ctrl_c_while_loading_is_exit_130_not_a_traceback():
    import signal
    import time

    proc = subprocess.Popen(
        # HF's modules, no EOS, 480 tokens: still running when the signal comes
        [sys.executable, "-m", "treespec", "generate", "x", "--max-new-tokens", "480", "--ignore-eos"]
        + ["--backend", "hf", "--dtype", "float32"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as a terminal's Ctrl-C finds it: a job started in the background (`cmd &` in a script)
        # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # inside main()'s guard: torch loads there (the module import before it loads none, tested
    # below), so a SIGINT once libtorch is mapped lands while loading or generating, never
    # during the interpreter's own start-up, however slow a busy machine makes that
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if not maps.exists() or "libtorch" in maps.read_text():
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err


def test_the_command_module_imports_without_torch():
    """`python -m treespec` and the `treespec` script import treespec.cli before main()'s
    KeyboardInterrupt guard: torch loading there made an early Ctrl-C a traceback (exit -2)."""
    code = "import sys, treespec.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_every_front_end_takes_every_load_option():
    """generate, chat, bench and serve take a flag for each of from_pretrained's options (one
    argparse group, `treespec.options`), so none of them lags behind (the server lacked
    --quantize)."""
    import inspect

    from treespec.decoder import SpeculativeDecoder
    from treespec.serve.cli import add_arguments as serve_arguments

    options = set(inspect.signature(SpeculativeDecoder.from_pretrained).parameters)
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    serve = argparse.ArgumentParser()
    serve_arguments(serve)
    for name, p in [(c, commands[c]) for c in ("generate", "chat", "bench")] + [("serve", serve)]:
        flags = {a.dest for a in p._actions}
        assert options <= flags, (name, options - flags)


def test_a_bad_verification_name_fails_before_loading(capsys, monkeypatch):
    import treespec.options

    monkeypatch.setattr(treespec.options, "load_decoder", lambda *a, **k: pytest.fail("loaded"))
    assert main(["generate", "x", "--verification", "blok"]) == 2
    assert "verification must be one of token, block, traversal or 'auto'" in capsys.readouterr().err


def test_the_stats_say_how_the_forward_ran():
    from types import SimpleNamespace

    from treespec.cli.generate import forward

    assert forward(SimpleNamespace(compiled=object(), compile_setting="auto")) == "compiled forward"
    assert "--compile once" in forward(SimpleNamespace(compiled=None, compile_setting="auto"))
    assert forward(SimpleNamespace(compiled=None, compile_setting=False)) == "eager forward"
