"""llama.cpp as a bench baseline (`treespec.bench.llamacpp`): parsing its logs, finding its binaries,
and its rows in `run_bench`. CI has no llama.cpp: the binaries here are stand-ins that print
what llama.cpp's print (the log lines below are copied from real runs of
llama-completion and llama-speculative-simple built by experiments/build/build_llama_cpp.sh) and
record the arguments they were given."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
import torch

from treespec import SamplingConfig, TreeConfig
from treespec.bench.harness import run_bench
from treespec.bench.llamacpp import LlamaCpp, LlamaCppBench, parse_decode, parse_speculative
from treespec.bench.results import result_table
from treespec.cli import main

DECODE_LOG = """\
0.00.663.786 I common_perf_print:    sampling time =      24.28 ms
0.00.663.787 I common_perf_print:    samplers time =      22.23 ms /   107 tokens
0.00.663.813 I common_perf_print:        load time =      89.90 ms
0.00.663.814 I common_perf_print: prompt eval time =      89.34 ms /    43 tokens (    2.08 ms per token,   481.32 tokens per second)
0.00.663.815 I common_perf_print:        eval time =     376.43 ms /    63 runs   (    5.98 ms per token,   167.36 tokens per second)
0.00.663.816 I common_perf_print:       total time =     493.25 ms /   106 tokens
"""  # noqa: E501

SPECULATIVE_LOG = """\
0.02.310.101 I encoded   44 tokens in    0.095 seconds, speed:  463.158 t/s
0.02.310.102 I decoded  129 tokens in    2.213 seconds, speed:   58.292 t/s
0.02.310.103 I
0.02.310.104 I n_draft   = 3
0.02.310.105 I n_predict = 129
0.02.310.106 I n_drafted = 282
0.02.310.107 I n_accept  = 35
0.02.310.108 I accept    = 12.411%
"""


def test_parse_decode_reads_llama_cpp_timers():
    run = parse_decode(DECODE_LOG)
    assert run.tokens == 64 and run.prompt_tokens == 43  # 63 decode runs + the prompt's token
    assert run.seconds == pytest.approx((24.28 + 89.34 + 376.43) / 1e3)  # sampling + prompt + decode
    assert run.tokens_per_second == pytest.approx(64 / 0.49005)


def test_parse_speculative_reads_its_summary():
    run = parse_speculative(SPECULATIVE_LOG)
    assert (run.tokens, run.prompt_tokens, run.drafted, run.accepted) == (129, 44, 282, 35)
    assert run.seconds == pytest.approx(0.095 + 2.213)


@pytest.mark.parametrize("parse", [parse_decode, parse_speculative])
def test_a_log_without_timings_is_an_error_that_shows_its_end(parse):
    with pytest.raises(RuntimeError, match="log ends: .*failed to load model"):
        parse("llama_model_load: error loading model\nmain: error: failed to load model 'x.gguf'\n")


FAKE = """#!{python}
import json, sys
args = sys.argv[1:]
with open({record!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if "--fail" in open({flags!r}).read():
    print("error: failed to load model", file=sys.stderr)
    sys.exit(1)
log = {log!r}
n = len(args[args.index("-p") + 1].split())  # the stand-in's tokens: one per word
print(log.replace(" 43 tokens", f" {{n}} tokens").replace(" 44 tokens", f" {{n}} tokens"))
"""


def fake_llama_cpp(root: Path) -> Path:
    """A source-tree-like directory: build/bin/ with stand-ins for both binaries (each records
    its arguments in root/calls.jsonl) and convert_hf_to_gguf.py at the top."""
    bin_dir = root / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (root / "flags").write_text("")
    for name, log in (("llama-completion", DECODE_LOG), ("llama-speculative-simple", SPECULATIVE_LOG)):
        path = bin_dir / name
        path.write_text(
            FAKE.format(
                python=sys.executable, record=str(root / "calls.jsonl"), flags=str(root / "flags"), log=log
            )
        )
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (root / "convert_hf_to_gguf.py").write_text("")
    return root


def calls(root: Path) -> list[list[str]]:
    return [json.loads(line) for line in (root / "calls.jsonl").read_text().splitlines()]


def test_find_looks_in_the_directory_its_bin_and_build_bin(tmp_path):
    root = fake_llama_cpp(tmp_path / "llama.cpp")
    for d in (root, root / "build", root / "build" / "bin"):
        found = LlamaCpp.find(d)
        assert found.decode_binary == root / "build" / "bin" / "llama-completion"
        assert found.speculative_binary == root / "build" / "bin" / "llama-speculative-simple"
        assert found.convert_script == root / "convert_hf_to_gguf.py"


def test_find_without_a_directory_uses_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert LlamaCpp.find() is None
    root = fake_llama_cpp(tmp_path / "llama.cpp")
    monkeypatch.setenv("PATH", str(root / "build" / "bin"))
    assert LlamaCpp.find().decode_binary == root / "build" / "bin" / "llama-completion"


def test_find_refuses_a_directory_without_binaries(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LlamaCpp.find(tmp_path / "missing")
    with pytest.raises(ValueError, match="no llama-completion in .*build_llama_cpp.sh"):
        LlamaCpp.find(tmp_path)


def test_a_failing_binary_is_a_runtime_error_with_its_message(tmp_path):
    root = fake_llama_cpp(tmp_path)
    (root / "flags").write_text("--fail")
    with pytest.raises(RuntimeError, match="llama-completion exited with status 1: .*failed to load model"):
        LlamaCpp.find(root).decode(Path("m.gguf"), "a b c", 8)


def test_llama_cpp_rows_in_run_bench(tmp_path, target64, draft64):
    """run_bench runs llama.cpp interleaved with the other methods on the same prompts (as
    text), with the bench's sampling, length and the tree's depth as the draft length."""
    root = fake_llama_cpp(tmp_path)
    bench = LlamaCppBench(LlamaCpp.find(root), Path("t.gguf"), Path("d.gguf"))
    prompts = [[5, 6, 7], [8, 9]]

    class Words:  # decodes ids to one word each, so the fake's word count is the prompt's length
        pad_token_id = 0

        def decode(self, ids, skip_special_tokens=False):
            return " ".join(f"w{i}" for i in ids)

    result = run_bench(
        target64,
        draft64,
        Words(),
        prompts,
        6,
        TreeConfig(2, 3),
        SamplingConfig(temperature=0.7),
        repeats=2,
        methods=["autoregressive"],
        backends=("native",),
        llama_cpp=bench,
    )
    rows = {r.method: r for r in result.methods}
    assert set(rows) == {"llama.cpp", "llama.cpp-spec", "autoregressive[native]"}
    assert len(rows["llama.cpp"].runs) == 4 and rows["llama.cpp"].tokens_per_second == pytest.approx(
        64 / 0.49005
    )
    assert rows["llama.cpp-spec"].acceptance_rate == pytest.approx(35 / 282)
    assert result.config["llama_cpp"]["prompt_length_mismatches"] == 0
    table = result_table(result)  # llama.cpp's rows: an acceptance rate, no step counts
    assert "llama.cpp-spec" in table and f"{35 / 282:.2f}" in table
    made = calls(root)
    assert len(made) == 8  # 2 repeats x 2 prompts x 2 methods, interleaved
    for args in made:
        assert args[args.index("-n") + 1] == "6" and "--ignore-eos" in args
        assert args[args.index("--temp") + 1] == "0.7" and args[args.index("--top-k") + 1] == "0"
        assert args[args.index("-m") + 1] == "t.gguf"
    spec = [a for a in made if "-md" in a]
    assert len(spec) == 4 and all(a[a.index("--spec-draft-n-max") + 1] == "3" for a in spec)
    assert [a[a.index("-p") + 1] for a in made[:2]] == ["w5 w6 w7"] * 2


def test_bench_cli_refuses_a_bad_llama_cpp_dir_before_loading(tmp_path, capsys):
    args = ["bench", "--n-prompts", "1", "--json", str(tmp_path / "b.json")]
    assert main(args + ["--llama-cpp", str(tmp_path / "missing")]) == 2
    assert "--llama-cpp" in capsys.readouterr().err
    root = fake_llama_cpp(tmp_path / "llama.cpp")
    # the test pair's target is a safetensors directory: llama.cpp needs a GGUF file
    assert main(args + ["--llama-cpp", str(root)]) == 2
    err = capsys.readouterr().err
    assert "--llama-cpp runs the target's GGUF file" in err and not (root / "calls.jsonl").exists()


def test_draft_gguf_of_a_subset_draft_has_zero_rows_outside_the_subset(tmp_path, draft64, monkeypatch):
    """The converted draft is the full-vocabulary equivalent with plain (bias-free) output rows,
    zero outside the subset, handed to the convert script with the target's tokenizer."""
    from treespec.backends.subset import VocabMap
    from treespec.bench import llamacpp

    seen = {}

    def convert(args):
        seen["args"] = args
        from safetensors.torch import load_file

        seen["weights"] = load_file(Path(args[2]) / "model.safetensors")

    class Tok:
        def save_pretrained(self, d):
            (Path(d) / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(llamacpp, "_run", convert)
    vocab = VocabMap(torch.tensor([3, 5, 7, 11]), draft64.config.vocab_size)
    small = draft64.__class__(draft64.config.__class__(**{**draft64.config.to_dict(), "vocab_size": 5}))
    out = llamacpp.draft_to_gguf(small, Tok(), tmp_path, Path("convert_hf_to_gguf.py"), vocab)
    assert out == tmp_path / "draft.gguf" and seen["args"][-3:] == [str(out), "--outtype", "f16"]
    head = seen["weights"]["lm_head.weight"]  # [V, h]
    assert "lm_head.bias" not in seen["weights"] and head.shape[0] == draft64.config.vocab_size
    inside = torch.zeros(head.shape[0], dtype=torch.bool)
    inside[[3, 5, 7, 11]] = True
    assert (head[~inside] == 0).all() and (head[inside] != 0).any(dim=1).all()
    assert (tmp_path / "draft-hf" / "tokenizer.json").exists()
