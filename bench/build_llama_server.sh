#!/usr/bin/env bash
# Build llama.cpp's own llama-server once, from the source vendored in the llama-cpp-python sdist
# (PyPI), into an ignored cache folder. Used only by the benchmark as a peer. Not GGML_NATIVE: on
# these VMs the CPU reports AMX, and a native build dies with SIGILL when it uses it.
set -euo pipefail
out=${1:-.cache/peers}
bin="$out/llama-server"
[ -x "$bin" ] && "$bin" --version >/dev/null 2>&1 && { echo "$bin already built"; exit 0; }
mkdir -p "$out/src"
py=${PYTHON:-.venv/bin/python}
ls "$out"/src/llama_cpp_python-*.tar.gz >/dev/null 2>&1 || "$py" -m pip download --quiet --no-deps --no-binary :all: -d "$out/src" "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ls -d "$out"/src/llama_cpp_python-*/ >/dev/null 2>&1 || tar -xzf "$out"/src/llama_cpp_python-*.tar.gz -C "$out/src"
src=$(ls -d "$out"/src/llama_cpp_python-*/vendor/llama.cpp)
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON >/dev/null
cmake --build "$out/build" --target llama-server -j "$(nproc)"
ln -sf "$(realpath "$out/build/bin/llama-server")" "$bin"  # links to the shared libraries beside it
echo "built $bin"
