# Two entry points on a fresh machine: `make demo` (the main job) and `make test`.
# Both create or reuse .venv; the stamp makes a second run skip the install.
PY      := .venv/bin/python
STAMP   := .venv/.kvproc-installed
TORCH   := torch==2.13.0

.PHONY: demo test venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py kvproc/native/_native.c kvproc/native/_slotmap.c kvproc/native/_native.h
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# CPU wheel first, so nothing below pulls a multi-GB CUDA build of torch.
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvproc demo

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m kvproc bench all

clean:
	rm -rf .venv build *.egg-info kvproc/native/*.so
