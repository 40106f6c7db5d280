# syntax=docker/dockerfile:1
#
# kelastic: the operator and the sidecar in one slim image (no torch: the trainer's own
# image runs the workers; this one runs next to it).
#
#   build:    docker build -t ghcr.io/kelastic/kelastic:0.1.0 .
#   operator: docker run IMAGE                      (default CMD: kelastic-operator)
#             docker run IMAGE kelastic-operator --standalone ...
#             (deploy/operator.yaml runs `python -m kelastic_operator`: the same thing)
#   sidecar:  docker run -e KELASTIC_HEALTH_URL=http://127.0.0.1:9400/healthz IMAGE kelastic-sidecar
#   CLI:      docker run IMAGE kelastic --help
#
# Behind a TLS-intercepting proxy, hand pip the proxy's CA bundle as a build secret:
#   docker build --secret id=pip-cert,src=/etc/ssl/certs/ca-certificates.crt .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a wheel of this project (hatchling) with its sidecar and operator extras, in a
# venv (a plain `pip install kelastic` is the worker library alone: the trainer's image) ----
FROM ${PYTHON_IMAGE} AS build
SHELL ["/bin/sh", "-eu", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv

# Dependencies first, from pyproject.toml alone (the extras sidecar and operator): this
# layer survives source edits.
COPY pyproject.toml README.md ./
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi; \
    python -c 'import tomllib; x = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print(*sorted({r for e in ("sidecar", "operator") for r in x[e] if not r.startswith("kelastic")}), sep="\n")' \
        > /tmp/requirements.txt; \
    /opt/venv/bin/pip install --no-cache-dir --requirement /tmp/requirements.txt

# The wheel, then a runtime-only venv: no pip/setuptools, and no kubernetes/aio (recent
# kubernetes clients bundle an asyncio twin of the client, ~70 MB, a fifth of the image;
# kelastic uses the sync client, and kopf talks to the API by itself).
COPY worker_lib ./worker_lib
COPY etcd_client ./etcd_client
COPY sidecar ./sidecar
COPY operator ./operator
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi; \
    /opt/venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . ; \
    for whl in /wheels/kelastic-*.whl; do \
        /opt/venv/bin/pip install --no-cache-dir "${whl}[sidecar,operator]"; \
    done; \
    /opt/venv/bin/pip uninstall --yes pip setuptools; \
    rm -rf /opt/venv/lib/python3*/site-packages/kubernetes/aio

# ---- runtime: slim base, the venv, a non-root user ----
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kelastic" \
      org.opencontainers.image.description="kelastic operator and sidecar: elastic, fault-tolerant PyTorch training on Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kelastic/kelastic"
# 65532 is the uid/gid deploy/operator.yaml runs as (runAsNonRoot).
RUN groupadd --system --gid 65532 kelastic \
    && useradd --system --uid 65532 --gid 65532 --home-dir /home/kelastic --create-home \
        --shell /usr/sbin/nologin kelastic \
    && install -d -o 65532 -g 65532 -m 0755 /var/run/kelastic
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KELASTIC_HEALTH_URL=http://127.0.0.1:8080/metrics
USER 65532:65532
WORKDIR /home/kelastic
# 8080: the operator's /metrics; 9400: the sidecar's /metrics /healthz /readyz /status.
EXPOSE 8080 9400
# The operator answers on /metrics; run the sidecar with
# KELASTIC_HEALTH_URL=http://127.0.0.1:9400/healthz. (Kubernetes ignores HEALTHCHECK
# and uses the probes in deploy/ and the Pods the operator builds.)
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['KELASTIC_HEALTH_URL'], timeout=4)"]
CMD ["kelastic-operator"]
