# The operator image: `overlap operator` without torch or the model stack (the operator imports only the
# engine's config types). Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/overlap-dev/overlap-operator:0.1.0 .
# (Not built in CI here: no Docker daemon, no network to the registries.)
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/overlap
# What `overlap operator` imports, pinned to the versions the tests ran with; numpy because the CLI's
# command table loads `overlap bench`'s registration. The package itself goes in with --no-deps (no torch).
RUN /opt/overlap/bin/pip install \
      kopf==1.45.2 kubernetes==37.0.2 aiohttp==3.14.5 prometheus-client==0.26.0 PyYAML==6.0.4 \
      msgspec==0.23.0 numpy==2.4.6
COPY pyproject.toml README.md /src/
COPY cli /src/cli
COPY engine /src/engine
COPY sidecar /src/sidecar
COPY operator /src/operator
COPY bench /src/bench
RUN /opt/overlap/bin/pip install --no-deps /src

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/overlap /opt/overlap
ENV PATH=/opt/overlap/bin:$PATH PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
RUN groupadd --gid 10001 overlap && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin overlap
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["overlap"]
CMD ["operator", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090"]
