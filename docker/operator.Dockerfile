# The operator image: `overlap operator` without torch or the model stack (the operator imports only the
# engine's config types, from the engine's base distribution). Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/overlap-dev/overlap-operator:0.1.0 .
# `make images` builds it here with buildah FROM a Debian base (scripts/build-images.sh).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The versions the tests ran with (`make constraints` writes it from .venv).
COPY docker/constraints.txt /src/constraints.txt
RUN python3 -m venv /opt/overlap
# The operator component and the engine's torch-free base (config, live knobs, the `overlap` command).
COPY engine /src/engine
COPY operator /src/operator
RUN /opt/overlap/bin/pip install -c /src/constraints.txt /src/engine /src/operator

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/overlap /opt/overlap
ENV PATH=/opt/overlap/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
RUN groupadd --gid 10001 overlap && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin overlap
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["overlap"]
CMD ["operator", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090"]
