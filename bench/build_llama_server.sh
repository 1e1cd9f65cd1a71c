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
# AVX-512 (and its BF16/VNNI parts) only where this CPU has them: a build that assumes them dies
# with SIGILL on an AVX2-only EPYC.
isa_flags() {
  local f; f=$(grep -m1 '^flags' /proc/cpuinfo)
  if [[ $f == *" avx512f "* ]]; then
    echo -n "-DGGML_AVX512=ON"
    [[ $f == *" avx512_bf16 "* ]] && echo -n " -DGGML_AVX512_BF16=ON"
    [[ $f == *" avx512_vnni "* ]] && echo -n " -DGGML_AVX512_VNNI=ON"
  else
    echo -n "-DGGML_AVX512=OFF"
  fi
}
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON $(isa_flags) >/dev/null
cmake --build "$out/build" --target llama-server -j "$(nproc)"
ln -sf "$(realpath "$out/build/bin/llama-server")" "$bin"  # links to the shared libraries beside it
echo "built $bin"
