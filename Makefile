# The two commands the README starts with. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test test-fast lint install clean notebooks

# Every CPU job below runs with these. One thread per process: the jobs run 2 processes on 2 cores.
# glibc hands every freed block over 32 MiB back to the kernel (munmap) and faults the pages in
# again on the next step; the models' activations are such blocks, so 15-20% of prepare's time went
# to page faults. These keep blocks up to 256 MiB in the heap and trim it past 512 MiB (glibc 2.36):
# prepare 10-20% faster, the suite 1094 s against 1128-1164 s (benchmarks/cpu_allocator.py; docs/benchmarks.md).
CPU_ENV := OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912

# The last step imports librosa's feature functions once: numba compiles librosa's kernels (~30 s on
# 2 cores; speaker similarity uses them) on their first import and caches them in the environment,
# so the first run that scores speech does not pay it.
$(BIN)/tts-lightning: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev,ray,eval]'
	$(BIN)/python -c "import librosa; librosa.feature.melspectrogram"
	touch $@

install: $(BIN)/tts-lightning

# The evaluation page's test drives Debian's chromium through Playwright (Playwright's own browser
# download cannot reach its servers): installed once, where it is missing.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

# The demo: build the tiny model, fine-tune it on the two demo speakers with FSDP on 2 CPU
# processes (with samples, spectrograms beside the real clips and the codebook chart in TensorBoard:
# configs/demo/listen.yaml), export the last checkpoint as a custom_voice model and speak with it.
# `--ckpt_path last`: a second `make demo` continues the first (an interrupted one resumes).
demo: install
	$(CPU_ENV) $(BIN)/tts-lightning tiny-model runs/tiny-model
	$(CPU_ENV) $(BIN)/tts-lightning fit --config configs/tiny-cpu.yaml --config configs/demo/listen.yaml \
		--data.pretrained runs/tiny-model --ckpt_path last
	$(CPU_ENV) $(BIN)/tts-lightning export --overwrite --dtype fp32 \
		--ckpt runs/tiny-cpu/checkpoints/last.ckpt \
		--out runs/tiny-cpu/voice
	$(CPU_ENV) $(BIN)/tts-lightning synthesize --model runs/tiny-cpu/voice --speaker alice \
		--text "Hello from tts-lightning." --out runs/tiny-cpu/hello_alice.wav

# Two pytest-xdist workers: run one after the other the tests left a core idle half the time
# (most wait on process start-up, imports and collectives). Each test file goes to one worker
# (loadfile), so a module's fixtures (the README's command chain, a fit, a Ray cluster) are built
# once; the session's (`make demo`'s workspace) once per worker. docs/testing.md has the figures.
test: install $(CHROMIUM)
	$(CPU_ENV) TTS_LIGHTNING_NO_SKIPS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30

# The edit loop: everything but the multi-process and long-running tests (marked slow); the
# durations show a test that belongs in the slow tier.
test-fast: install $(CHROMIUM)
	$(CPU_ENV) TTS_LIGHTNING_NO_SKIPS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=10

# The notebooks are stored with the outputs of an executed run; after changing a cell (or what a
# cell shows), re-execute and store them (tests/test_notebooks.py checks they still match).
notebooks: install
	$(CPU_ENV) $(BIN)/python scripts/store_notebook_outputs.py

# Lint, format and types (the same checks as .pre-commit-config.yaml); CI runs it before the tests.
LINT_PATHS := tts_lightning tests benchmarks scripts
lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/codespell $(LINT_PATHS) configs docs README.md
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs
