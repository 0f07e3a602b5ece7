# Two entry points on a fresh clone: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Keep every Ray process we start on 127.0.0.1 (Ray binds to the routable address otherwise), with
# token authentication: Serve replicas listen on all interfaces for inter-deployment gRPC, and the
# token is what refuses strangers there (serve_app/local_ray.py). The token itself is made per run.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := token
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: venv test test-fast demo clean

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU torch wheel first, so no dependency pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# Everything: unit tests, local-mode graphs, learning runs, real clusters, benchmark smoke runs. Two
# workers: each module that starts Ray runs whole on one of them, so its cluster starts once (tests/conftest.py).
test: venv
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10 tests

# The quick loop: plain classes and Serve's local testing mode, no cluster, no learning runs.
test-fast: venv
	$(PY) -m pytest -q -m "not slow and not cluster and not gpu" tests

# FlowGRPO on CPU against the app deployed on a local Ray cluster (loopback only). Default: the
# shipped shapes-world model learning to draw what its prompts ask (held-out accuracy in eval.csv).
# `make demo STEPS=100` is shorter (the default: the world's trainer config's trainer.steps),
# `make demo OUT=outputs/mine` picks the output folder, `make demo WORLD=video` trains the moving-shapes
# video model (direction accuracy in eval.csv), `make demo WORLD=edit` trains the shipped editing model
# (held-out edit accuracy in eval.csv), `make demo WORLD=brightness STEPS=60` runs the random tiny model on
# the brightness reward, `make demo TRANSPORT=http` trains over the app's HTTP API alone (no Ray in the
# trainer's process; docs/http.md), `make demo ALGO=diffusion_nft` trains with another algorithm of
# configs/algorithm/ (mix_grpo, dance_grpo, diffusion_nft, grpo_guard; docs/training.md).
STEPS ?=
OUT ?= outputs/demo
WORLD ?= shapes
TRANSPORT ?= handle
ALGO ?= flow_grpo
demo: venv
	WORLD=$(WORLD) STEPS=$(STEPS) OUT=$(OUT) TRANSPORT=$(TRANSPORT) ALGO=$(ALGO) PY=$(PY) scripts/demo.sh

clean:
	rm -rf $(VENV) .pytest_cache
