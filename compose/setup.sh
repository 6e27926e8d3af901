#!/usr/bin/env bash
# Once, before the first `docker compose up`, from anywhere:
#
#   compose/setup.sh proxy.example.com      # the name (or IP) outside workers use for this host
#
# makes what compose needs and a fresh clone lacks, keeping any file that is already there:
# - compose/.env from .env.example, with fresh secrets (MinIO, and the actor, learner and
#   admin tokens the proxy accepts: compose hands them to it, nothing is typed twice) and
#   PRESIGN_ENDPOINT naming that host (MinIO serves plain HTTP on 9000);
# - certs/cert.pem and certs/key.pem at the repository root (where deploy/'s recipes read
#   the CA too): a self-signed certificate for `proxy` (compose's own actors), localhost and
#   that host, valid for CERT_DAYS (default 365) days. Put a CA-signed pair there instead if
#   you have one.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
host=${1:-${PUBLIC_HOST:-localhost}}
days=${CERT_DAYS:-365}
secret() { openssl rand -hex 24; }

if [ -e "$here/.env" ]; then
  echo "kept $here/.env"
else
  # secrets are born private: umask 077 before the file exists, not a chmod after it was readable
  (umask 077 && sed -e "s|^MINIO_ROOT_PASSWORD=.*|MINIO_ROOT_PASSWORD=$(secret)|" \
      -e "s|^ACTOR_TOKEN=.*|ACTOR_TOKEN=$(secret)|" \
      -e "s|^LEARNER_TOKEN=.*|LEARNER_TOKEN=$(secret)|" \
      -e "s|^ADMIN_TOKEN=.*|ADMIN_TOKEN=$(secret)|" \
      -e "s|^PRESIGN_ENDPOINT=.*|PRESIGN_ENDPOINT=http://$host:9000|" \
      "$here/.env.example" > "$here/.env.tmp")
  mv "$here/.env.tmp" "$here/.env"
  echo "wrote $here/.env (fresh secrets; edit RUN, MODEL, DATASET, REWARD, GPUs there)"
fi

mkdir -p "$root/certs"
if [ -e "$root/certs/cert.pem" ]; then
  echo "kept $root/certs/cert.pem"
else
  if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then san="IP:$host"; else san="DNS:$host"; fi
  (umask 077 && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
      -subj "/CN=spotgrpo proxy" -addext "subjectAltName=DNS:proxy,DNS:localhost,IP:127.0.0.1,$san" \
      -addext "basicConstraints=critical,CA:TRUE" \
      -keyout "$root/certs/key.pem" -out "$root/certs/cert.pem" 2>/dev/null)
  chmod 644 "$root/certs/cert.pem"  # the certificate is public: every container reads it
  echo "wrote $root/certs/cert.pem and key.pem for proxy, localhost and $host;" \
       "it expires on $(openssl x509 -enddate -noout -in "$root/certs/cert.pem" | cut -d= -f2)"
fi
echo "next: cd $here && docker compose up -d --build   (outside workers: compose/spot-worker.sh)"
