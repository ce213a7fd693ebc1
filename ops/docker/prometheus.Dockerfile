# Prometheus from Debian's package on the same base image as pagedserve: it builds where no
# container registry is reachable. The scrape configuration is ops/prometheus.yml.
ARG BASE_IMAGE=pagedserve-base:bookworm
FROM ${BASE_IMAGE}
COPY ops/docker/certs/ /usr/local/share/ca-certificates/extra/
RUN update-ca-certificates >/dev/null \
    && apt-get update && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus
COPY ops/prometheus.yml /etc/prometheus/prometheus.yml
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
            "--web.listen-address=:9090"]
