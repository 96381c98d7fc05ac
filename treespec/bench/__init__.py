"""Speed comparison in one process: treespec against Hugging Face `generate()` (and llama.cpp).

Methods (all on the same target/draft, same prompts, same max_new_tokens):

    hf              target.generate()                         plain HF decoding
    hf-assisted     target.generate(assistant_model=draft)    HF's linear speculative decoding
    llama.cpp       llama-completion on the target's GGUF     with `llama_cpp` (`bench.llamacpp`)
    llama.cpp-spec  llama-speculative-simple, the draft's GGUF  ... and a draft GGUF
    autoregressive  treespec, tree=None                       the in-library baseline
    linear          treespec, TreeConfig(width=1, depth)
    tree            treespec, TreeConfig(width, depth, strategy)
    goodput         treespec, the linear chain with plain_fallback=True: per request, speculate
                    or decode plainly by which measured more tokens/s (not run by default)

treespec methods run once per backend ("linear[native]", "linear[hf]", ...) and, given several
verification rules, once per rule that applies to the method's tree ("linear/block[native]";
"auto" = the decoder's default, the best rule that applies). Runs are interleaved (repeat ->
prompt -> method) so that slow drifts of the machine hit every method alike; each method's
tokens/s is the median over its runs. Forward costs are measured through the runners
(synchronising on CUDA): t(1), t(n)/t(1), c = t_draft(1)/t_target(1), and the floor: weight
bytes / measured memory bandwidth, as a ratio to the measured t(1).

    harness.py   run_bench (the interleaved runs), native_runners, encode_batch
    results.py   the methods, MethodResult / BenchResult and the table (no torch)
    measure.py   forward_seconds, memory_bandwidth, cost_ratios, machine_info
    llamacpp.py  llama.cpp's binaries as a baseline, and GGUF conversion of drafts and heads

`treespec bench` (`treespec.cli.bench`) is the command.
"""
