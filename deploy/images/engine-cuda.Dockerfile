# syntax=docker/dockerfile:1
# The CUDA engine image (`pdconnect-engine` in deploy/base; engine-cuda in the H20
# overlays): the upstream vLLM 0.33.0 OpenAI server image plus this package with its
# `gpu` extra (CUDA Mooncake Transfer Engine and NIXL). Built by `make images`.
#
# Base images are pinned: python by tag and digest; vllm/vllm-openai by its exact
# release tag only (no published digest was at hand; pin one in your registry).

# Stage 1: a wheel of this repository (pure Python, so any interpreter builds it).
FROM python:3.11.7-slim-bookworm@sha256:d11b9bd5e49ea7401753d78f4d3b56f3aec952b85b49bcae88981f0452818e0b AS wheel
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
# Runs as root on purpose: registering the KV cache with the RDMA NIC needs an effective
# CAP_IPC_LOCK, which Kubernetes grants only to UID 0 (deploy/README.md, "Engines run as
# UID 0"). The pod drops every other capability and mounts the root filesystem read-only.
ENV HOME=/home/vllm
# What deploy/base runs (`vllm serve --config ...`).
ENTRYPOINT ["vllm", "serve"]
