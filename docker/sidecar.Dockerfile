# The sidecar image: `overlap sidecar` (OpenAI API, admission, metrics, live config) without torch or the model
# stack; set it as an InferenceService's `spec.images.sidecar` to keep the pod's HTTP container small. It also runs
# the gateway (`overlap router`, `overlap activator`): the operator starts their pods from this image.
# Build from the repository root:  docker build -f docker/sidecar.Dockerfile -t ghcr.io/overlap-dev/overlap-sidecar:0.1.0 .
# `make images` builds it here with buildah FROM a Debian base (scripts/build-images.sh).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The versions the tests ran with (`make constraints` writes it from .venv).
COPY docker/constraints.txt /src/constraints.txt
RUN python3 -m venv /opt/overlap
COPY engine /src/engine
COPY openai /src/openai
COPY sidecar /src/sidecar
COPY gateway /src/gateway
RUN /opt/overlap/bin/pip install -c /src/constraints.txt /src/engine /src/openai /src/sidecar /src/gateway

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/overlap /opt/overlap
# HOME and the tokenizer files the engine sends (written under the temp folder) live on the /tmp emptyDir (the
# root filesystem is read-only in the pod).
ENV PATH=/opt/overlap/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
RUN groupadd --gid 10001 overlap && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin overlap
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 8001
ENTRYPOINT ["overlap"]
CMD ["sidecar", "--help"]
