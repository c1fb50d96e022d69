# Tandem CPU images, two targets from one file:
#
#   docker build --target frontend -t tandem-frontend:0.1.0 .   # tokenizer + gRPC, no torch
#   docker build --target engine   -t tandem-engine:0.1.0 .     # torch (CPU) + the C++ kernel
#   docker run --rm -p 50051:50051 tandem-engine:0.1.0 tandem serve --host 0.0.0.0
#                                      # 1 engine + frontend in one container (the engine image
#                                      # holds everything; the frontend image holds no engine)
#   docker compose up --build          # the full stack (see deploy/README.md)
#
# Expected sizes (uncompressed): frontend ~0.45 GB (python:3.11-slim ~0.13 GB plus ~0.3 GB
# installed: transformers 126 MB, numpy 45 MB, grpcio, tokenizers, opentelemetry, and what
# huggingface_hub pulls in); engine ~1.5 GB (the same plus torch's CPU build, ~0.75 GB
# installed, sympy/networkx, and g++ for the kernel). The frontend runs `pip install .` only
# (the base dependencies) and its build fails if torch ends up in it.
#
# The demo model is made at build time into /models/demo of the engine image, and its
# tokenizer and config files (no weights) are copied into the frontend image, so every
# container agrees on the tokenizer fingerprint. To serve another checkpoint, mount it in
# both and point TANDEM_MODEL at it (-v /path:/models/mine -e TANDEM_MODEL=/models/mine);
# the frontend needs only its tokenizer and config files.

# ---- common base: Python, the unprivileged user, the package sources ------------------------
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin tandem \
    && mkdir -p /models /cache \
    && chown tandem:tandem /models /cache

WORKDIR /build
COPY pyproject.toml README.md ./
COPY engine_service ./engine_service
COPY frontend_service ./frontend_service
COPY kernels ./kernels
COPY tandem ./tandem

# ---- engine: torch CPU build, the C++ attention kernel, the demo model -----------------------
FROM base AS engine

# g++: the CPU attention kernel (kernels/csrc) is compiled by torch.utils.cpp_extension.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from PyTorch's CPU index (the PyPI wheel would pull in CUDA libraries);
# `pip install .[engine]` then finds torch==2.13.0 satisfied and leaves it alone.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

RUN pip install ".[engine]" \
    && cd / && rm -rf /build \
    && python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

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

EXPOSE 50061 8001

# gRPC health probe (grpc.health.v1, overall service ""): exit 0 only when SERVING.
# docker-compose.yml uses the same probe, with each service's own port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys,grpc;from grpc_health.v1 import health_pb2 as p,health_pb2_grpc as g;r=g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(p.HealthCheckRequest(),timeout=3);sys.exit(r.status!=p.HealthCheckResponse.SERVING)", "127.0.0.1:50061"]

CMD ["tandem", "engine", "--host", "0.0.0.0", "--port", "50061"]

# ---- the demo model's tokenizer and config, without its weights ----------------------------
# (make-model needs torch, so building the frontend target builds the engine stage too; only
# these files reach the frontend image.)
FROM engine AS demo-tokenizer
RUN mkdir /tmp/demo-tokenizer \
    && cp /models/demo/*.json /models/demo/*.jinja /tmp/demo-tokenizer/

# ---- frontend: the base install only (no torch, no compiler) --------------------------------
FROM base AS frontend

RUN pip install . \
    && cd / && rm -rf /build \
    && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in the frontend image'"

COPY --from=demo-tokenizer --chown=tandem:tandem /tmp/demo-tokenizer /models/demo

USER tandem
WORKDIR /home/tandem

# TANDEM_MODEL: the checkpoint directory the frontend reads its tokenizer and config from.
ENV TANDEM_MODEL=/models/demo
RUN python -c "import sys, frontend_service.server; assert 'torch' not in sys.modules"

EXPOSE 50051 8000 8080

# The same probe as the engine's, on the frontend's port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys,grpc;from grpc_health.v1 import health_pb2 as p,health_pb2_grpc as g;r=g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(p.HealthCheckRequest(),timeout=3);sys.exit(r.status!=p.HealthCheckResponse.SERVING)", "127.0.0.1:50051"]

CMD ["tandem", "frontend", "--host", "0.0.0.0", "--port", "50051"]

# ---- smg: the optional SMG front door (docker compose --profile smg; deploy/k8s/optional) ----
# SMG (Shepherd Model Gateway, a Rust binary in the `smg` wheel) speaks vLLM's gRPC protocol
# to the engines; it reads the demo checkpoint's tokenizer and chat template from here.
FROM python:3.11-slim AS smg
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install smg==1.13.0 \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin tandem
COPY --from=demo-tokenizer --chown=tandem:tandem /tmp/demo-tokenizer /models/demo
USER tandem
WORKDIR /home/tandem
EXPOSE 30000
CMD ["smg", "launch", "--backend", "vllm", "--host", "0.0.0.0", "--port", "30000", "--model-path", "/models/demo", "--policy", "cache_aware", "--worker-urls", "grpc://engine-0:50061", "grpc://engine-1:50061"]
