#!/usr/bin/env bash
# spotgrpo rollout workers as Hugging Face Jobs (the platform of HF's async GRPO recipe):
# each job is one worker on one GPU that joins the run through the proxy. It needs the
# proxy's address, an actor token and, for a self-signed proxy certificate, the CA; no
# Redis, no bucket credentials. The image is compose/Dockerfile's, pushed where HF Jobs
# can pull it (Docker Hub, or any public registry):
#
#   docker build -f compose/Dockerfile -t docker.io/you/spotgrpo:latest . && docker push docker.io/you/spotgrpo:latest
#
# then, from the repository root, with your actor token in SPOTGRPO_TOKEN:
#
#   PROXY=https://proxy.example.com:8443 RUN=qwen-gsm8k-1 MODEL=Qwen/Qwen2.5-0.5B-Instruct \
#   IMAGE=docker.io/you/spotgrpo:latest WORKERS=4 deploy/hf-jobs.sh
#
# A job that ends (its --timeout, a cancel) hands its batch back on SIGTERM; start another
# and it carries on. `hf jobs ps` lists them, `hf jobs logs <id>` shows `actors check`'s
# table first, `hf jobs cancel <id>` stops one.
set -euo pipefail
: "${PROXY:?https://host:8443 of proxy serve}" "${RUN:?the learner's --run}" "${MODEL:?the learner's --model}"
: "${IMAGE:?the spotgrpo image, pushed to a registry}" "${SPOTGRPO_TOKEN:?an actor token}"
WORKERS=${WORKERS:-1}
FLAVOR=${FLAVOR:-l4x1}
# the CA travels as text (a secret, like the token) and spot-worker.sh writes it to a file:
# certs/cert.pem (compose/setup.sh's), or SPOTGRPO_CA_PEM as given ('' for a proxy whose
# certificate a public CA signed)
if [ -z "${SPOTGRPO_CA_PEM+set}" ]; then
  if [ ! -s certs/cert.pem ]; then
    echo "hf-jobs.sh: no certs/cert.pem here (run from the repository root, after compose/setup.sh);" \
         "for a proxy with a publicly signed certificate set SPOTGRPO_CA_PEM=''" >&2
    exit 2
  fi
  SPOTGRPO_CA_PEM=$(cat certs/cert.pem)
fi
export SPOTGRPO_CA_PEM
for _ in $(seq "$WORKERS"); do
  hf jobs run --detach --flavor "$FLAVOR" --timeout 24h \
    -e PROXY="$PROXY" -e RUN="$RUN" -e MODEL="$MODEL" \
    -s SPOTGRPO_TOKEN -s SPOTGRPO_CA_PEM \
    "$IMAGE" spot-worker.sh
done
