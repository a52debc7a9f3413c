# syntax=docker/dockerfile:1
# The router image (`pdconnect-router`): `pdconnect router` with the package's base
# dependencies only — no torch, no vLLM (tests/test_images.py resolves its install to
# prove it). Built by `make images`.

FROM python:3.11.16-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b AS python-base

# Stage 1: the virtual environment. `connectors/` (the only code importing vLLM) is not
# copied, so it is not in the image at all.
FROM python-base AS build
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md constraints-cpu.txt ./
COPY pdconnect ./pdconnect
# No extras: the base dependencies, at the versions the test suite runs with.
RUN pip install --no-cache-dir pip==25.3 \
    && pip install --no-cache-dir -c constraints-cpu.txt .

# Stage 2: the runtime.
FROM python-base
# The pod runs as UID/GID 10001 (deploy/base/router.yaml's securityContext).
RUN groupadd --gid 10001 pdconnect \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin pdconnect
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 10001:10001
# What deploy/base/router.yaml runs (its arguments come from the manifest).
ENTRYPOINT ["pdconnect", "router"]
