#!/usr/bin/env bash
# Make this machine (Debian, as root) ready to build and run compose.yaml with no registry:
# Debian's docker.io and docker-compose, a running dockerd, the local base image, and in the
# build context the host's extra CA certificates and a CPU build of torch where the host has one.
set -euo pipefail
cd "$(dirname "$0")/../.."
export DEBIAN_FRONTEND=noninteractive
need=()
for tool in docker:docker.io dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool##*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get install -y -q "${need[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${need[@]}" >/dev/null 2>&1; }
fi
if ! docker info >/dev/null 2>&1; then
  nohup dockerd >/tmp/dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -5 /tmp/dockerd.log; exit 1; }
fi
docker image inspect pagedserve-base:bookworm >/dev/null 2>&1 || bash ops/docker/build-base-image.sh >/dev/null
cp /usr/local/share/ca-certificates/*.crt ops/docker/certs/ 2>/dev/null || true
for wheel in /opt/wheels/torch-2.13.0+cpu-*.whl; do
  [ -f "$wheel" ] && cp -n "$wheel" ops/docker/wheels/
done
echo "docker engine ready: $(docker version --format '{{.Server.Version}}')"
