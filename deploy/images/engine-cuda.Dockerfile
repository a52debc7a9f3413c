# syntax=docker/dockerfile:1
# The CUDA engine image (`pdconnect-engine` in deploy/base; engine-cuda in the H20
# overlays): the upstream vLLM 0.33.0 OpenAI server image plus this package with its
# `gpu` extra (CUDA Mooncake Transfer Engine and NIXL). Built by `make images`.
#
# Base images are pinned: python by tag and digest (Docker Official Image index digest of
# python:3.11.16-slim-bookworm, as docker-library/repo-info records it); vllm/vllm-openai
# by its exact release tag only: no digest of it could be obtained where this was written
# (no registry reachable). Pin the one your registry mirrors (deploy/README.md, Images).

# Stage 1: a wheel of this repository (pure Python, so any interpreter builds it).
FROM python:3.11.16-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdconnect ./pdconnect
COPY connectors ./connectors
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: vLLM's own image, our wheel on top.
FROM vllm/vllm-openai:v0.33.0
ARG PDCONNECT_VERSION=0.1.0
# What Mooncake's engine.so links besides CUDA (readelf -d on the 0.3.13.post1 wheel):
# the verbs library and the NIC providers (libmlx5 on H20 nodes; UCX uses them too),
# libnuma and libcurl. The Ubuntu release of the vLLM base image fixes their versions,
# so the base tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/images/constraints-gpu.txt /tmp/constraints-gpu.txt
COPY --from=wheel /wheels /tmp/wheels
# uv is how the vLLM image installs into its interpreter; the constraints keep the
# image's vLLM and pin the transports.
RUN uv pip install --system --no-cache --constraint /tmp/constraints-gpu.txt \
        "/tmp/wheels/pdconnect-${PDCONNECT_VERSION}-py3-none-any.whl[gpu]" \
    && rm -rf /tmp/wheels /tmp/constraints-gpu.txt
# The pods run as UID/GID 10001 without capabilities (deploy/base's securityContext);
# RDMA registration then needs the node's memlock limit, not CAP_IPC_LOCK
# (deploy/README.md, "Engines run as UID 10001"). HOME is the pods' writable volume.
RUN groupadd --gid 10001 vllm \
    && useradd --uid 10001 --gid 10001 --home-dir /home/vllm --create-home --shell /usr/sbin/nologin vllm
ENV HOME=/home/vllm
USER 10001:10001
# What deploy/base runs (`vllm serve --config ...`).
ENTRYPOINT ["vllm", "serve"]
