# The control-plane image: gateway/admin/node API (`llmgw server`), control worker (`llmgw worker`) and
# mirror (`llmgw mirror serve`). Node workers run on the GPU machines themselves, beside their engines.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir .
ENV LLMGW_HOST=0.0.0.0 LLMGW_STATE_DIR=/var/lib/llmgw
ENTRYPOINT ["llmgw"]
