#!/usr/bin/env bash
# A/B of `kvproc bench replay --vs-vllm` between source trees, in one run: each tree's replay followed by its own
# vLLM KVCacheManager replay (the same trace, same flags), trees alternating, so each ratio pairs kvproc and vLLM
# within ~a minute and each A/B pair shares the machine's state (2 shared vCPUs: vLLM's own rate moves 240-450
# req/s between runs). Usage: bench/replay_ab.sh "<replay flags>" TREE_A TREE_B [...]; a tree is a source checkout
# with its native module built (`git archive <rev> | tar -x -C DIR; (cd DIR && python setup.py build_ext -i -q)`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
flags=$1
shift
for tree in "$@"; do
  echo "== $tree ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)): $flags"
  (cd "$tree" && "$root/.venv/bin/python" -m kvproc bench replay --vs-vllm $flags \
     --trace "$root/../shared/traces/mooncake_conversation_trace.jsonl" --vllm-python "$root/.venv-vllm/bin/python" \
     | grep -E "requests/s|token hit")
done
