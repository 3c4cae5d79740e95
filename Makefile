# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test install lock proto bench clean

# Installs from requirements.lock (the resolved set CI tested), so every fresh machine gets the same versions.
$(STAMP): pyproject.toml requirements.lock
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "pip<26"
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c requirements.lock -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Re-resolves the dependency set after a change to pyproject.toml and writes it to requirements.lock.
lock: $(STAMP)
	$(BIN)/pip install -q -U -e ".[test]"
	{ head -2 requirements.lock; $(BIN)/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > requirements.lock.tmp
	mv requirements.lock.tmp requirements.lock

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
