#!/usr/bin/env bash
# Build llama.cpp's llama-server for the serving benchmarks, and llama-quantize next to it (for
# benchmarks/make_kquant_files.py), from the llama.cpp sources vendored in the llama-cpp-python
# sdist (PyPI is reachable where GitHub may not be). Prints llama-server's path; llama-quantize
# is in the same directory:
#   python benchmarks/serving_bench.py --llama-server "$(benchmarks/build_llama_server.sh)"
#   python benchmarks/make_kquant_files.py --llama-quantize "$(dirname "$(benchmarks/build_llama_server.sh)")/llama-quantize"
# Needs a C++ compiler, cmake and ninja; about 4 minutes on 2 cores.
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
work="${1:-${TMPDIR:-/tmp}/stoic-llama-cpp}"
python="${PYTHON:-.venv/bin/python}"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -x "$src/build/bin/llama-server" ] || [ ! -x "$src/build/bin/llama-quantize" ]; then
  if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$work"
    "$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
    tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
  fi
  cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON >&2
  cmake --build "$src/build" --target llama-server llama-quantize -j "$(nproc)" >&2
fi
echo "$src/build/bin/llama-server"
