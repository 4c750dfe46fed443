# The two commands the README starts with. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
RUN    ?= runs/demo

.PHONY: demo test install clean

$(BIN)/tts-lightning: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev]'
	touch $@

install: $(BIN)/tts-lightning

# The demo: build the tiny model and speak one clip with it.
demo: install
	OMP_NUM_THREADS=1 $(BIN)/tts-lightning tiny-model $(RUN)/tiny-model
	OMP_NUM_THREADS=1 $(BIN)/tts-lightning synthesize --model $(RUN)/tiny-model \
		--ref-audio tts_lightning/demo/clips/alice/alice_000.flac \
		--text "Hello from tts-lightning." --out $(RUN)/hello.wav

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
