# The two commands the README starts with. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test test-fast lint install clean

# The last step imports librosa's feature functions once: numba compiles librosa's kernels (~30 s on
# 2 cores; speaker similarity uses them) on their first import and caches them in the environment,
# so the first run that scores speech does not pay it.
$(BIN)/tts-lightning: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev,ray,eval]'
	$(BIN)/python -c "import librosa; librosa.feature.melspectrogram"
	touch $@

install: $(BIN)/tts-lightning

# The demo: build the tiny model, fine-tune it on the two demo speakers with FSDP on 2 CPU
# processes, export the last checkpoint as a custom_voice model and speak with the new voice.
demo: install
	OMP_NUM_THREADS=1 $(BIN)/tts-lightning tiny-model runs/tiny-model
	OMP_NUM_THREADS=1 $(BIN)/tts-lightning fit --config configs/tiny-cpu.yaml --data.pretrained runs/tiny-model
	OMP_NUM_THREADS=1 $(BIN)/tts-lightning export --overwrite --dtype fp32 \
		--ckpt runs/tiny-cpu/checkpoints/last.ckpt \
		--out runs/tiny-cpu/voice
	OMP_NUM_THREADS=1 $(BIN)/tts-lightning synthesize --model runs/tiny-cpu/voice --speaker alice \
		--text "Hello from tts-lightning." --out runs/tiny-cpu/hello_alice.wav

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=30

# The edit loop: everything but the multi-process and long-running tests (marked slow); the
# durations show a test that belongs in the slow tier.
test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow" --durations=10

# Lint, format and types (the same checks as .pre-commit-config.yaml); CI runs it before the tests.
LINT_PATHS := tts_lightning tests benchmarks scripts
lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/codespell $(LINT_PATHS) configs docs README.md
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs
