# trainapp: one training loop (DDP or FSDP2, mixed precision) for a laptop, torchrun, Slurm, Ray and Kubernetes.
# `make help` lists the targets. Variables below can be overridden: `make run NPROC=4 ARGS="train.max_steps=50"`.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
NPROC ?= 2
RUN_DIR ?= runs/run-$(shell date +%Y%m%d-%H%M%S)
ARGS ?=
PYTEST_ARGS ?=
BENCH_ARGS ?=
# The local Ray cluster (make ray-up): its state, token and logs live outside the repository.
RAY_DIR ?= /tmp/trainapp-ray-$(shell id -u)
RAY_WORKERS ?= 2
RAY_CPUS ?= 1
RAY_PORT ?= 26379
RAY_DASHBOARD_PORT ?= 28265
# A private tmpfs of this size on each worker node's /dev/shm (e.g. 256m; root): a lost node takes its
# memory-tier copies with it, as a real node would. Empty: the nodes share this machine's /dev/shm.
RAY_NODE_MEMORY ?=
RAY_STORAGE ?= $(CURDIR)/runs/ray
RAY_NAME ?= demo
# A directory Ray ships with `make ray-submit` (your task's package: docs/your-own-model.md).
WORKING_DIR ?=
# Images (docker/Dockerfile): $(IMAGE):$(TAG)-gpu and $(IMAGE):$(TAG)-cpu
IMAGE ?= trainapp
TAG ?= 0.1.0
DOCKER ?= docker
DOCKER_BUILD_ARGS ?=
# Extra sbatch options for slurm-submit, e.g. "--nodes=4 --time=12:00:00 --partition=gpu".
SBATCH_ARGS ?=
# Namespace of the Kubernetes manifests (k8s/00-namespace.trainapp.yaml).
K8S_NS ?= trainapp
# Build args are passed only when given on the make command line, never from the environment: a host
# PIP_FIND_LINKS path means nothing inside a build, and the Dockerfile's pinned defaults must hold.
IMAGE_ARG_VARS := GPU_BASE CPU_BASE TORCH_CUDA TORCH_INDEX_URL PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_NO_INDEX
IMAGE_BUILD_ARGS = $(foreach v,$(IMAGE_ARG_VARS),$(if $(filter command line,$(origin $(v))),--build-arg $(v)="$($(v))")) \
  --build-arg VCS_REF="$(shell git rev-parse HEAD 2>/dev/null)"

BIN := $(VENV)/bin
# One .venv, two levels, each redone when pyproject.toml changes: RUN_STAMP, trainapp and its dependencies
# (what `make run` and the launch targets need); DEV_STAMP, the dev extra on top (tests, mypy, benchmarks).
# DEV_STAMP keeps the name of the single stamp before the split: a dev .venv made then stays valid.
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed
TOOLS ?= .venv-tools
TOOLS_STAMP := $(TOOLS)/.installed

##@ General

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make \033[36m<target>\033[0m [VAR=value ...]\n"} \
	  /^[a-zA-Z0-9_-]+:.*?##/ { printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2 } \
	  /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

##@ Setup

# --no-compile: pip byte-compiles every module it installs (torch, Ray: ~25 s of the 2-core first `make run`);
# Python compiles the modules a run imports on first use instead. The dev install also satisfies a run: it
# touches RUN_STAMP, so `make run` after `make test` installs nothing.
$(RUN_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q --no-compile -e .
	@touch $@

$(DEV_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	@touch $@ $(RUN_STAMP)

.PHONY: venv
venv: $(DEV_STAMP) ## Create .venv (Python 3.11) and install trainapp with its dev extra (what the tests need)

.PHONY: venv-run
venv-run: $(RUN_STAMP) ## Create .venv with trainapp and its dependencies only (what make run installs)

$(TOOLS_STAMP): requirements-tools.txt
	@test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --disable-pip-version-check -q -r requirements-tools.txt
	@touch $@

.PHONY: tools
tools: $(TOOLS_STAMP) ## Create .venv-tools with the static checkers (checkov, yamllint, hadolint, kubernetes-validate, ruff)

##@ Run

.PHONY: run
run: $(RUN_STAMP) ## Built-in default: a short 2-process DDP + AMP run on CPU (NPROC, RUN_DIR, ARGS)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) \
	  -m trainapp train run.dir=$(RUN_DIR) $(ARGS)

.PHONY: config
config: $(RUN_STAMP) ## Print the resolved config (CONFIG=file.yaml, ARGS="key=value ...")
	$(BIN)/python -m trainapp config $(if $(CONFIG),--config $(CONFIG)) $(ARGS)

.PHONY: config-reference
config-reference: $(RUN_STAMP) ## Print the configuration reference table of docs/configuration.md (from the field docstrings)
	@$(BIN)/python -m trainapp config --reference

##@ Images

.PHONY: image
image: ## Build the GPU image $(IMAGE):$(TAG)-gpu (TORCH_CUDA=cu130: driver >= 580; GPU_BASE, TORCH_INDEX_URL, PIP_*, DOCKER_BUILD_ARGS)
	$(DOCKER) build -f docker/Dockerfile --target gpu -t $(IMAGE):$(TAG)-gpu $(IMAGE_BUILD_ARGS) $(DOCKER_BUILD_ARGS) .

.PHONY: image-cpu
image-cpu: ## Build the CPU image $(IMAGE):$(TAG)-cpu (CPU_BASE, TORCH_INDEX_URL, PIP_*, DOCKER_BUILD_ARGS)
	$(DOCKER) build -f docker/Dockerfile --target cpu -t $(IMAGE):$(TAG)-cpu $(IMAGE_BUILD_ARGS) $(DOCKER_BUILD_ARGS) .

##@ Ray (a real multi-node Ray cluster on this machine)

.PHONY: ray-up
ray-up: $(RUN_STAMP) ## Start a head (no task CPUs) and RAY_WORKERS worker nodes of RAY_CPUS CPUs, token auth on
	$(BIN)/python -m devtools.local_ray --dir $(RAY_DIR) up --workers $(RAY_WORKERS) --cpus $(RAY_CPUS) \
	  --port $(RAY_PORT) --dashboard-port $(RAY_DASHBOARD_PORT) $(if $(RAY_NODE_MEMORY),--node-memory $(RAY_NODE_MEMORY))

.PHONY: ray-submit
ray-submit: $(RUN_STAMP) ## ray job submit a training run to it (ARGS, RAY_NAME: same name resumes, RAY_STORAGE, WORKING_DIR: your task's code)
	$(BIN)/python -m devtools.local_ray --dir $(RAY_DIR) submit $(if $(WORKING_DIR),--working-dir $(WORKING_DIR)) \
	  -- python -m trainapp ray \
	  ray.storage_path=$(RAY_STORAGE) ray.name=$(RAY_NAME) $(ARGS)

.PHONY: ray-status
ray-status: $(RUN_STAMP) ## Alive nodes, addresses and token file of the local Ray cluster
	$(BIN)/python -m devtools.local_ray --dir $(RAY_DIR) status

.PHONY: ray-down
ray-down: $(RUN_STAMP) ## Stop exactly the processes ray-up started (never other Ray instances)
	$(BIN)/python -m devtools.local_ray --dir $(RAY_DIR) down

##@ Slurm

.PHONY: slurm-submit
slurm-submit: $(RUN_STAMP) ## sbatch slurm/train.sbatch from here (ARGS, CONFIG, RUN_DIR on shared storage, SBATCH_ARGS="--nodes=4")
	ARGS="$(ARGS)" VENV="$(abspath $(VENV))" $(if $(CONFIG),CONFIG="$(abspath $(CONFIG))") \
	  $(if $(filter command line,$(origin RUN_DIR)),RUN_DIR="$(abspath $(RUN_DIR))") \
	  sbatch $(SBATCH_ARGS) slurm/train.sbatch

.PHONY: slurm-smoke
slurm-smoke: $(DEV_STAMP) ## Needs root: installs Debian's slurmctld, slurmd, munge; a private 2-node Slurm runs slurm/train.sbatch through a preemption and bad input
	@if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
	    || ! command -v munged >/dev/null; then \
	  echo "installing Debian's slurmctld slurmd slurm-client munge"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null; \
	fi
	$(BIN)/python -m pytest --slurm -m slurm --durations=5 tests/test_slurm.py $(PYTEST_ARGS)

##@ Kubernetes

.PHONY: k8s-token
k8s-token: ## Create the Secret ray-auth-token (random token) in namespace K8S_NS if it does not exist
	@kubectl get namespace $(K8S_NS) >/dev/null 2>&1 || kubectl apply -f k8s/00-namespace.trainapp.yaml
	@if kubectl -n $(K8S_NS) get secret ray-auth-token >/dev/null 2>&1; then \
	  echo "secret $(K8S_NS)/ray-auth-token exists (delete it to rotate the token, then restart the Ray pods)"; \
	else \
	  kubectl -n $(K8S_NS) create secret generic ray-auth-token \
	    --from-literal=token="$$($(PYTHON) -c 'import secrets; print(secrets.token_hex(32))')"; \
	fi

.PHONY: k8s-render-kind
k8s-render-kind: ## Print the kind overlay (k8s/overlays/kind-cpu) as plain YAML, for `| kubectl apply -f -`
	@kubectl kustomize --load-restrictor=LoadRestrictionsNone k8s/overlays/kind-cpu

.PHONY: k8s-render-kind-kuberay
k8s-render-kind-kuberay: ## Print the KubeRay kind overlay (k8s/overlays/kind-cpu-kuberay: the RayCluster on CPU) as plain YAML
	@kubectl kustomize --load-restrictor=LoadRestrictionsNone k8s/overlays/kind-cpu-kuberay

.PHONY: kind-smoke
kind-smoke: ## Needs Docker + kind: CPU image, kind cluster, job survives a deleted worker pod (scripts/kind-smoke.sh)
	scripts/kind-smoke.sh

.PHONY: container-smoke
container-smoke: $(RUN_STAMP) ## Needs root, docker.io, debootstrap: CPU image, Ray head + 2 worker containers, jobs survive a killed and a stopped worker
	RAY=$(abspath $(BIN))/ray DOCKER=$(DOCKER) $(BIN)/python scripts/container_smoke.py

##@ Test

.PHONY: lint
lint: $(TOOLS_STAMP) ## ruff over the package, tests, benchmarks and scripts (pyproject.toml: line length, complexity, arguments)
	$(TOOLS)/bin/ruff check --output-format concise .

.PHONY: typecheck
typecheck: $(DEV_STAMP) ## mypy over trainapp/ (pyproject.toml [tool.mypy]: every function typed); a warm cache takes seconds
	$(BIN)/mypy

# Two pytest-xdist workers, a test file each at a time: the suite alone keeps about 1.15 of 2 cores busy
# (its processes wait on signals, timeouts, leases and clusters), two lanes fill the idle one. Runs the
# tests share (conftest.py's `shared`) are made once across both. TEST_WORKERS=0: one lane.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# ruff and mypy go beside the suite, not before it: a fresh mypy is a minute of one core, which the suite
# leaves idle (it keeps about 1.8 of 2 cores busy); a failed check fails `make test` once the suite ends.
.PHONY: test
test: $(DEV_STAMP) $(TOOLS_STAMP) ## The suite: every subsystem end to end, but the fault-scenario files of test-long and test-e2e, benchmarks, real Slurm; two lanes (TEST_WORKERS=2, PYTEST_ARGS="-k resume -x"); ruff and mypy beside it
	@$(MAKE) --no-print-directory -j3 lint typecheck test-suite

.PHONY: test-suite
test-suite: $(DEV_STAMP) $(TOOLS_STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not long" --durations=15 $(PYTEST_ARGS)

.PHONY: test-long
test-long: $(DEV_STAMP) $(TOOLS_STAMP) ## The fault-scenario files (tests/conftest.py LONG: Ray, kills, preemption, lease, FSDP, hangs, full disks, failures, compile, tracking) make test leaves out; CI runs it after make test
	$(BIN)/python -m pytest $(XDIST) -m long --durations=15 $(PYTEST_ARGS)

.PHONY: test-e2e
test-e2e: $(DEV_STAMP) $(TOOLS_STAMP) ## The long end-to-end fault scenarios (Ray faults, hangs, namespaces) in two lanes; CI runs them after make test-long
	$(BIN)/python -m pytest $(XDIST) --e2e -m e2e --durations=15 $(PYTEST_ARGS)

# CI's one session for both: a Ray cluster started once for test_ray.py's long and e2e tests, the straight
# twins (conftest.py's session fixtures) trained once, and no lane left idle while the other finishes the
# first tier's last file. The same tests, markers and two lanes as the two targets above.
.PHONY: test-long-e2e
test-long-e2e: $(DEV_STAMP) $(TOOLS_STAMP) ## make test-long and make test-e2e as one session in two lanes; CI runs it after make test
	$(BIN)/python -m pytest $(XDIST) --e2e -m "long or e2e" --durations=15 $(PYTEST_ARGS)

.PHONY: bench-smoke
bench-smoke: $(DEV_STAMP) ## Every benchmark in its smoke mode, checked (tests/test_bench.py; make test and CI leave them out: run it for a change to bench/)
	$(BIN)/python -m pytest --bench -m bench --durations=6 tests/test_bench.py $(PYTEST_ARGS)

# Another Ray, for `test-ray-oldest`: a venv with only that Ray installed (no dependencies), which finds
# everything else (torch, trainapp, pytest, Ray's own dependencies) in .venv through a .pth file: seconds
# to make instead of a second copy of torch. Its torchrun runs its own python, so its Ray.
RAY_OLDEST_VENV ?= .venv-ray-oldest
RAY_UNSUPPORTED_VENV ?= .venv-ray-unsupported
# The spare processes ask the Raylet directly; a drain and a lost node ask Ray what each version says.
RAY_OLDEST_TESTS ?= test_job_submit or drill or same_parameters or drained or bad_ray_input \
                    or lost_node or memory_in_spare
define other_ray_venv
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/pip install --disable-pip-version-check -q --no-deps "ray[default,train]==$$($(BIN)/python -c \
	  'from trainapp.launch.ray import checks; print(checks.$(2))')"
	echo "import site; site.addsitedir('$$($(BIN)/python -c 'import site; print(site.getsitepackages()[0])')')" \
	  > "$$($(1)/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_trainapp_base.pth"
	printf '#!%s\nfrom torch.distributed.run import main\nmain()\n' "$(abspath $(1))/bin/python" > $(1)/bin/torchrun
	chmod +x $(1)/bin/torchrun
	@touch $(1)/.installed
endef

$(RAY_OLDEST_VENV)/.installed: $(DEV_STAMP) trainapp/launch/ray/checks.py
	$(call other_ray_venv,$(RAY_OLDEST_VENV),OLDEST_TESTED)

$(RAY_UNSUPPORTED_VENV)/.installed: $(DEV_STAMP) trainapp/launch/ray/checks.py
	$(call other_ray_venv,$(RAY_UNSUPPORTED_VENV),UNSUPPORTED_TESTED)

.PHONY: test-ray-oldest
test-ray-oldest: $(RAY_OLDEST_VENV)/.installed $(RAY_UNSUPPORTED_VENV)/.installed ## The Ray tests on the oldest supported Ray (its own venv), and a Ray below the range refused; CI runs it
	TRAINAPP_RAY_UNSUPPORTED_PYTHON=$(abspath $(RAY_UNSUPPORTED_VENV))/bin/python \
	  $(RAY_OLDEST_VENV)/bin/python -m pytest --e2e --durations=10 tests/test_ray_compat.py tests/test_ray.py \
	  tests/test_ray_resume.py \
	  -k "compat or $(RAY_OLDEST_TESTS)" $(PYTEST_ARGS)

.PHONY: test-fast
test-fast: $(DEV_STAMP) $(TOOLS_STAMP) lint typecheck ## The edit-test loop: ruff and mypy, then every test that starts no training process, cluster, namespace or container
	$(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# No stamp prerequisite: a GPU machine gets a copy of .venv and no network, where a stamp older than
# pyproject.toml (mtimes are not always kept by the copy) would start a pip install that cannot succeed.
.PHONY: gpu-check
gpu-check: ## On a GPU machine, under 8 min: bf16/fp16, killed-and-resumed bitwise, compile + warm resume, checkpointing memory, FSDP, ResNet-50 img/s (bench/results/gpu.json; OUT=dir); without CUDA exit 2
	@test -x $(BIN)/python || { echo "gpu-check: $(BIN)/python is missing: run make venv first" >&2; exit 2; }
	$(BIN)/python scripts/gpu_check.py

##@ Benchmarks

.PHONY: bench
bench: $(DEV_STAMP) ## Run every benchmark, then one summary table: bench/results/*.json, summary.md (BENCH_ARGS="--smoke")
	$(BIN)/python -m bench.loop_overhead $(BENCH_ARGS)
	$(BIN)/python -m bench.launchers $(BENCH_ARGS)
	$(BIN)/python -m bench.ray_floor $(BENCH_ARGS)
	$(BIN)/python -m bench.snapshot_cost $(BENCH_ARGS)
	$(BIN)/python -m bench.amp_cpu $(BENCH_ARGS)
	$(BIN)/python -m bench.preempt $(BENCH_ARGS)
	$(BIN)/python -m bench.hang $(BENCH_ARGS)
	$(BIN)/python -m bench.char_lm $(BENCH_ARGS)
	$(BIN)/python -m bench.resize $(BENCH_ARGS)
	$(BIN)/python -m bench.fsdp $(BENCH_ARGS)
	$(BIN)/python -m bench.export $(BENCH_ARGS)
	$(BIN)/python -m bench.stream $(BENCH_ARGS)
	$(BIN)/python -m bench.memory $(BENCH_ARGS)
	$(BIN)/python -m bench.summary $(if $(findstring --smoke,$(BENCH_ARGS)),--results bench/results/smoke)

##@ Clean

.PHONY: clean
clean: ## Remove run directories and caches (keeps .venv)
	rm -rf runs .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +

.PHONY: distclean
distclean: clean ## Also remove .venv and .venv-tools
	rm -rf $(VENV) $(TOOLS)
