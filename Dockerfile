# Tandem CPU image: one image for the frontend and the engine services.
#
#   docker build -t tandem:0.1.0 .
#   docker run --rm -p 50051:50051 tandem:0.1.0          # 1 engine + frontend in one container
#   docker compose up --build                            # the full stack (see deploy/README.md)
#
# The demo model is made at build time into /models/demo, so every container started from
# this image has the same weights and the same tokenizer fingerprint. To serve another
# checkpoint, mount it and point TANDEM_MODEL at it (-v /path:/models/mine -e TANDEM_MODEL=/models/mine).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++: the CPU attention kernel (kernels/csrc) is compiled by torch.utils.cpp_extension.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from PyTorch's CPU index (the PyPI wheel would pull in CUDA libraries);
# `pip install .` then finds torch==2.13.0 satisfied and leaves it alone.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /build
COPY pyproject.toml README.md ./
COPY engine_service ./engine_service
COPY frontend_service ./frontend_service
COPY kernels ./kernels
COPY tandem ./tandem
RUN pip install . \
    && cd / && rm -rf /build \
    && python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin tandem \
    && mkdir -p /models /cache \
    && chown tandem:tandem /models /cache
USER tandem
WORKDIR /home/tandem

# TANDEM_MODEL: the checkpoint the engines load and the frontend tokenizes with.
# TANDEM_CACHE_DIR: where a service would make the demo model if TANDEM_MODEL were unset.
# TORCH_EXTENSIONS_DIR: where the CPU kernel is built (once per CPU model; the build
# below is reused when the container runs on the same kind of CPU, rebuilt otherwise).
ENV TANDEM_MODEL=/models/demo \
    TANDEM_CACHE_DIR=/cache \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions
RUN tandem make-model --arch llama --preset demo --out /models/demo
RUN python -c "from kernels.cpu_ops import native_available; assert native_available()"

EXPOSE 50051 8000

# gRPC health probe (grpc.health.v1, overall service ""): exit 0 only when SERVING.
# docker-compose.yml uses the same probe, with each service's own port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys,grpc;from grpc_health.v1 import health_pb2 as p,health_pb2_grpc as g;r=g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(p.HealthCheckRequest(),timeout=3);sys.exit(r.status!=p.HealthCheckResponse.SERVING)", "127.0.0.1:50051"]

CMD ["tandem", "serve", "--host", "0.0.0.0", "--port", "50051"]
