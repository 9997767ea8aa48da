# The llmgw image: gateway/admin/node API (`llmgw server`), control worker (`llmgw worker`), mirror
# (`llmgw mirror serve`) and, in docker-compose.yml, a simulated node worker. Real node workers run on the
# GPU machines themselves, beside their engines (docs/operating.md). OTLP export is included for tracing.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir ".[otlp]"
ENV LLMGW_HOST=0.0.0.0 LLMGW_STATE_DIR=/var/lib/llmgw
ENTRYPOINT ["llmgw"]
