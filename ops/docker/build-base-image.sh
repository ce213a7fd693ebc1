#!/usr/bin/env bash
# Build the local base image `pagedserve-base:bookworm` from Debian packages with debootstrap,
# for machines that reach Debian's archive but no container registry. Where a registry is
# reachable, `docker-compose build --build-arg BASE_IMAGE=debian:bookworm-slim` skips this.
set -euo pipefail
image="${1:-pagedserve-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,gcc,libc6-dev \
  bookworm "$rootfs" "$mirror"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import - "$image"
echo "built $image"
