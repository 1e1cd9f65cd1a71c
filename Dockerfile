# One image for router, engine and worker; docker-compose.yml picks the command.
FROM python:3.11-slim
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*
COPY requirements.txt Makefile pyproject.toml ./
COPY protos ./protos
RUN make protos VENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH LLMSERVE_CACHE_DIR=/cache
COPY services ./services
RUN make kernels VENV=/opt/venv
COPY models.yaml ./
COPY data ./data
