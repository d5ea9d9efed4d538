#!/usr/bin/env bash
# `tokenmill bench serve` against llama.cpp's llama-server, then against `tokenmill serve`, with the same
# client flags, one server at a time (each uses both cores). llama-server comes from
# /work/shared/tools/build-llama-cpp.sh or any llama.cpp build: LLAMA_SERVER=path/to/llama-server.
# usage: [MODEL=name-or-.gguf] benchmarks/bench_serve_llama_cpp.sh [extra bench serve flags]
# (results in bench-results/; MODEL defaults to the embedded SmolLM2, or e.g. qwen2.5-coder-1.5b)
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/llama-cpp-bench/bin/llama-server}
MODEL=$(.venv/bin/python -c "import sys; from tokenmill.model.loader import resolve_model
print(resolve_model(sys.argv[1] or None).path)" "${MODEL:-}")
OUT=bench-results
mkdir -p "$OUT"
FLAGS=(--num-prompts 80 --concurrency 16 --input-len 128 --output-len 64 --ignore-eos --warmup 4 --local-only "$@")
# llama.cpp repacks Q4 weights for AMX unless told not to; on AMX CPUs its repacked path is slower here
EXTRA=(); grep -q amx_bf16 /proc/cpuinfo && EXTRA=(-nr)

wait_up() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }

echo "date: $(date -u +%F\ %T) cpu: $(lscpu | sed -n 's/^Model name: *//p') load: $(cut -d' ' -f1-3 /proc/loadavg)"
"$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port 8101 -np 16 -c 16384 -t 2 --cache-ram 0 "${EXTRA[@]}" \
    >"$OUT/llama-server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
wait_up http://127.0.0.1:8101
.venv/bin/tokenmill bench serve --base-url http://127.0.0.1:8101 "${FLAGS[@]}" --output-json "$OUT/llama-server.json"
kill $pid; wait $pid 2>/dev/null || true

.venv/bin/tokenmill serve --model "$MODEL" --port 8102 >"$OUT/tokenmill-serve.log" 2>&1 &
pid=$!
wait_up http://127.0.0.1:8102
.venv/bin/tokenmill bench serve --base-url http://127.0.0.1:8102 "${FLAGS[@]}" --output-json "$OUT/tokenmill.json"
kill -TERM $pid; wait $pid 2>/dev/null || true
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
