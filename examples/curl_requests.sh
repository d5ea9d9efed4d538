#!/usr/bin/env bash
# Raw HTTP against `tokenmill serve` (e.g. `make serve`).
set -euo pipefail
URL=${URL:-http://127.0.0.1:8000}

curl -s "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
echo
curl -sN "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "stream": true}'
curl -s "$URL/metrics" | grep -E '^tokenmill:(num_requests|kv_cache_usage|generation_tokens)'
