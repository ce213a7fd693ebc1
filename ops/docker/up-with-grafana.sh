#!/usr/bin/env bash
# Starts the stack with Grafana (`compose.yaml`'s grafana profile). Grafana's image comes only from
# a registry, and docker-compose spends minutes failing to pull it where none is reachable, so
# this checks first and fails at once, in one line, with what to do instead.
set -euo pipefail
cd "$(dirname "$0")/../.."

image=$(sed -n 's/^ *image: *\(grafana\/[^ ]*\).*/\1/p' compose.yaml | head -n 1)
registry=${GRAFANA_REGISTRY_PROBE:-https://registry-1.docker.io/v2/}

if ! docker image inspect "$image" >/dev/null 2>&1; then
    # Any HTTP answer (Docker Hub says 401 to an anonymous probe) means the pull can work.
    if ! curl -s -o /dev/null -m 5 "$registry"; then
        echo "up-with-grafana: image $image is not here and $registry cannot be reached;" \
            "load it with 'docker load -i grafana.tar' or import ops/grafana/dashboards/*.json" \
            "into a Grafana of your own, and start the rest with 'docker-compose up --build'" >&2
        exit 1
    fi
    docker pull "$image"
fi
COMPOSE_PROFILES="${COMPOSE_PROFILES:-cpu},grafana" exec docker-compose up "$@"
