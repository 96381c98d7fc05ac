#!/usr/bin/env bash
# Build llama.cpp's CPU binaries for `treespec bench --llama-cpp DIR` from the PyPI source
# distribution of llama-cpp-python (the llama.cpp it vendors), without a hub or git:
#
#     bash experiments/build/build_llama_cpp.sh [WORKDIR]      # default WORKDIR: ~/llamacpp
#     treespec bench --pair smollm2 --llama-cpp WORKDIR/llama_cpp_python-*/vendor/llama.cpp
#
# Needs cmake, a C++ compiler and (optionally) ninja; about 20 minutes on 2 cores. GGML_NATIVE
# tunes for this CPU (AVX-512, AVX512-BF16 where present). The source tree's
# convert_hf_to_gguf.py (which converts treespec's draft for llama.cpp's speculative decoding)
# imports numpy, torch and transformers, which treespec's environment has, and sentencepiece,
# which this script installs.
set -euo pipefail
VERSION=0.3.36
WORK=${1:-$HOME/llamacpp}
mkdir -p "$WORK" && cd "$WORK"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
    # the source distribution, not a wheel; its build tools (for metadata only) may be wheels
    pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d .
    tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
cd "llama_cpp_python-$VERSION/vendor/llama.cpp"
GEN=$(command -v ninja >/dev/null && echo "-G Ninja" || true)
cmake -B build $GEN -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)" --target llama-completion llama-speculative-simple llama-bench
pip install sentencepiece
echo "built: $PWD/build/bin (pass --llama-cpp $PWD)"
