# The llmgw image: gateway/admin/node API (`llmgw server`), control worker (`llmgw worker`), mirror
# (`llmgw mirror serve`) and, in docker-compose.yml, a simulated node worker. Real node workers run on the
# GPU machines themselves, beside their engines (docs/operating.md). OTLP export is included for tracing.
# BASE: any image with Python 3.11+ and its venv module (CI builds it on a Debian made by debootstrap,
# scripts/compose-ci); llmgw goes into a venv of its own, so a distribution's Python refuses nothing.
ARG BASE=python:3.11-slim
FROM ${BASE}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
RUN python3 -m venv /opt/llmgw && /opt/llmgw/bin/pip install --no-cache-dir ".[otlp]"
ENV PATH=/opt/llmgw/bin:$PATH LLMGW_HOST=0.0.0.0 LLMGW_STATE_DIR=/var/lib/llmgw
ENTRYPOINT ["llmgw"]
