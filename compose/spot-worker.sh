#!/usr/bin/env bash
# Join any GPU machine to a running job as a rollout worker. It needs the proxy's
# address, an actor token and the proxy's CA certificate: no Redis, no bucket
# credentials, no reward code (the trusted tier scores). SIGTERM (a spot notice) hands
# the batch in hand back; nothing is lost. For a learner that runs --scoring actors, set
# REWARD=module:function and the worker scores its own groups.
#
#   PROXY=https://proxy.example:8443 RUN=qwen-gsm8k-1 MODEL=Qwen/Qwen2.5-0.5B-Instruct \
#   SPOTGRPO_TOKEN=... SPOTGRPO_CA_CERT=cert.pem ./spot-worker.sh
set -euo pipefail
: "${PROXY:?https://host:8443 of proxy serve}" "${RUN:?the learner's --run}" "${MODEL:?the learner's --model}"
: "${SPOTGRPO_TOKEN:?an actor token}"
# the proxy's CA as text (a job platform's secret or environment variable) instead of a file
if [ -n "${SPOTGRPO_CA_PEM:-}" ] && [ -z "${SPOTGRPO_CA_CERT:-}" ]; then
  export SPOTGRPO_CA_CERT="${TMPDIR:-/tmp}/spotgrpo-ca.pem"
  printf '%s\n' "$SPOTGRPO_CA_PEM" > "$SPOTGRPO_CA_CERT"
fi
# every cheap check first (token, TLS, run, model, rank, rewards, an adapter download):
# a mismatch is named here, before the engine takes the GPU
actors check --queue "$PROXY" --run "$RUN" --engine vllm --model "$MODEL" --skip-engine ${REWARD:+--reward "$REWARD"}
exec actors run --queue "$PROXY" --run "$RUN" --engine vllm --model "$MODEL" --grace-s 60 \
    ${REWARD:+--reward "$REWARD"}
