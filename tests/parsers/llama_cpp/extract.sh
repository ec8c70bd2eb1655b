#!/usr/bin/env bash
# Regenerates cases.jsonl: llama.cpp's own chat parser cases (tests/test-chat.cpp), as data.
#
#   tests/parsers/llama_cpp/extract.sh [llama.cpp source dir]
#
# The llama.cpp is the one llama-cpp-python 0.3.36 vendors (commit 0c1e570; default:
# the sdist, downloaded). dump-cases.patch makes test-chat write each peg_tester case
# (template, model output, request parameters, expected message, and what llama.cpp
# derived: format, generation prompt, grammar triggers) as a JSON line when
# SLUICE_DUMP is set; test-chat then runs its whole suite as usual. Takes ~10 minutes
# on 2 cores (it builds llama.cpp's common library and server context).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="${1:-}"
work="$(mktemp -d)"
if [ -z "$src" ]; then
  pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$work"
  tar xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work"
  src="$work/llama_cpp_python-0.3.36/vendor/llama.cpp"
fi
(cd "$src" && patch -p1 --forward < "$here/dump-cases.patch")
cmake -S "$src" -B "$work/build" -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" --target test-chat -j"$(nproc)" >/dev/null
rm -f "$work/cases.jsonl"
(cd "$src" && SLUICE_DUMP="$work/cases.jsonl" "$work/build/bin/test-chat" >/dev/null 2>&1)
python3 "$here/slim.py" "$work/cases.jsonl" > "$here/cases.jsonl"
echo "wrote $here/cases.jsonl ($(wc -l < "$here/cases.jsonl") cases)"
