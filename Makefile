# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test install proto bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "pip<26"
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dgr2 demo --config configs/demo.yaml

test: $(STAMP)
	$(BIN)/python -m pytest tests -q

# Regenerates the committed stubs (protoc -I proto, then the one generated import made relative).
proto: $(STAMP)
	$(BIN)/python -c "from proto.diffusion_gr2 import regenerate_stubs; regenerate_stubs()"

bench: $(STAMP)
	$(BIN)/dgr2 bench

clean:
	rm -rf artifacts/demo
