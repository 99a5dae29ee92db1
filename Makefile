# Quick start: `make demo` runs the main job end to end; `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cloudckpt-installed
URL    ?=

.PHONY: venv demo test test-fast test-plain test-compat test-nemo test-integrations test-torchtitan test-deepspeed test-ray lint bench bench-quick fuzz clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

demo: venv
	$(BIN)/python examples/demo.py $(if $(URL),--url $(URL))

# The suite runs on TEST_WORKERS processes (pytest-xdist; each starts its own servers on
# free ports): 2 halves it on a 2-core machine (docs/testing.md).
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python tests/servers.py install-azurite >/dev/null  # Azure emulator, from npm
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=15

# The quick tier for iterating (about a minute on 2 cores): unit tests and the store
# tests that need none of rclone, the GCS emulator and Azurite (filesystem, memory, moto).
# `make test` stays the full suite, which CI runs.
test-fast: venv
	$(BIN)/python -m pytest -q tests/unit tests/stores \
		-m "not rclone and not gcs and not azure and not slow"

# The round-trip tests again with every fast path off (CLOUDCKPT_FAST_PATHS=0: no GC
# pauses, no views by address or GIL-held copies, no archive builders; docs/runtime.md):
# the plain path must give the same results.
PLAIN_TESTS := tests/unit/test_fast_paths.py tests/unit/test_gcpause.py \
	tests/unit/test_gil_held.py tests/unit/test_load_requests.py \
	tests/unit/test_weights_only_unpickler.py tests/integration/test_roundtrip.py \
	tests/integration/test_async_save.py tests/integration/test_shared_load.py \
	tests/dcp/test_reader_writer.py tests/dcp/test_shared_reads.py \
	tests/dcp/test_destinations.py tests/dcp/test_fetch.py tests/dcp/test_export.py \
	tests/safetensors/test_safetensors_io.py tests/safetensors/test_safetensors_faults.py \
	tests/manager/test_manager.py tests/megatron/test_megatron.py
test-plain: venv
	CLOUDCKPT_FAST_PATHS=0 $(BIN)/python -m pytest -q $(PLAIN_TESTS)

# Differential fuzzing of the trust boundary against torch's weights-only unpickler
# (tests/security/fuzz.py; docs/security.md). SEED= and CASES= change the run.
fuzz: venv
	$(BIN)/python tests/security/fuzz.py --seed $${SEED:-1} --cases $${CASES:-100000} --jobs 2

# The Lightning tests again against the oldest Lightning we support (2.4), and the
# Megatron tests against the older megatron-core layout we read and write (0.15).
LIGHTNING_MIN ?= 2.4.0
MCORE_OLD ?= 0.15.3
test-compat: venv
	test -d .cache/lightning-$(LIGHTNING_MIN) || $(BIN)/python -m pip install -q --no-deps \
		--target .cache/lightning-$(LIGHTNING_MIN) lightning==$(LIGHTNING_MIN)
	PYTHONPATH=.cache/lightning-$(LIGHTNING_MIN) $(BIN)/python -m pytest -q tests/lightning
	test -d .cache/megatron-core-$(MCORE_OLD) || $(BIN)/python -m pip install -q --no-deps \
		--target .cache/megatron-core-$(MCORE_OLD) megatron-core==$(MCORE_OLD)
	PYTHONPATH=.cache/megatron-core-$(MCORE_OLD) $(BIN)/python -m pytest -q tests/megatron \
		tests/dcp/test_metadata_compat.py

# $(call overlay-venv,DIR,REQUIREMENTS[,PIP_ARGS]): a venv at DIR that sees .venv's
# packages (torch, lightning, the test servers) through a .pth file, with REQUIREMENTS
# installed on top, so .venv itself is untouched; used by the NeMo, integrations and
# torchtitan environments below.
define overlay-venv
	test -x $(1)/bin/python || $(BIN)/python -m venv $(1)
	$(BIN)/python -c "import sysconfig; print('import site; site.addsitedir(%r)' \
		% sysconfig.get_paths()['purelib'])" > "$$($(1)/bin/python -c \
		"import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz-cloudckpt-venv.pth"
	$(1)/bin/python -m pip install -q $(3) -r $(2)
	touch $(1)/.cloudckpt-installed
endef

# cloudckpt.nemo against NeMo 2.7.3 (tests/nemo; docs/megatron.md). NeMo and what
# `import nemo.lightning` needs go into a venv of their own under .cache, which sees
# .venv's packages (torch, lightning, megatron-core, the test servers) through a .pth
# file, so .venv is untouched. The tests run with NeMo's own Lightning pin (2.4) and
# with .venv's Lightning, where tests/nemo/nemo_env.py applies the two import shims.
NEMO_VENV ?= .cache/nemo-2.7.3
NEMO_LIGHTNING ?= 2.4.0
NEMO_STAMP := $(NEMO_VENV)/.cloudckpt-installed
$(NEMO_STAMP): $(STAMP) tests/nemo/requirements.txt
	$(call overlay-venv,$(NEMO_VENV),tests/nemo/requirements.txt)

test-nemo: $(NEMO_STAMP)
	test -d .cache/lightning-$(NEMO_LIGHTNING) || $(BIN)/python -m pip install -q --no-deps \
		--target .cache/lightning-$(NEMO_LIGHTNING) lightning==$(NEMO_LIGHTNING)
	PYTHONPATH=.cache/lightning-$(NEMO_LIGHTNING) $(NEMO_VENV)/bin/python -m pytest -q tests/nemo
	$(NEMO_VENV)/bin/python -m pytest -q tests/nemo

# The trainers users already run (docs/integrations.md): the Hugging Face Trainer and
# Accelerate (tests/hf, tests/accelerate) in .cache/integrations, which sees .venv's
# packages through a .pth file (transformers 5 and accelerate go there, not into .venv),
# and torchtitan (tests/torchtitan) in .cache/torchtitan, the same way: its pins
# conflict with transformers 5, so it gets an environment of its own.
INTEGRATIONS_VENV ?= .cache/integrations
INTEGRATIONS_STAMP := $(INTEGRATIONS_VENV)/.cloudckpt-installed
$(INTEGRATIONS_STAMP): $(STAMP) tests/hf/requirements.txt
	$(call overlay-venv,$(INTEGRATIONS_VENV),tests/hf/requirements.txt)

test-integrations: $(INTEGRATIONS_STAMP)
	$(INTEGRATIONS_VENV)/bin/python -m pytest -q tests/hf tests/accelerate

# torchtitan's checkpoint code (tests/torchtitan; docs/integrations.md) in
# .cache/torchtitan. Only what `torchtitan.components.checkpoint` imports is installed,
# with --no-deps (tests/torchtitan/requirements.txt): about 10 s and 40 MB, the venv included.
TORCHTITAN_VENV ?= .cache/torchtitan
TORCHTITAN_STAMP := $(TORCHTITAN_VENV)/.cloudckpt-installed
$(TORCHTITAN_STAMP): $(STAMP) tests/torchtitan/requirements.txt
	$(call overlay-venv,$(TORCHTITAN_VENV),tests/torchtitan/requirements.txt,--no-deps)

test-torchtitan: $(TORCHTITAN_STAMP)
	$(TORCHTITAN_VENV)/bin/python -m pytest -q tests/torchtitan

# cloudckpt.deepspeed against DeepSpeed 0.19.8 (tests/deepspeed; docs/integrations.md) in
# .cache/deepspeed, which sees .venv's packages (CPU torch, the test servers) through a
# .pth file. DeepSpeed and the small packages it imports go in with --no-deps
# (tests/deepspeed/requirements.txt), so pip never swaps .venv's CPU torch for a CUDA
# one; its ops are not built (the tests skip compiling its CPU shared-memory op).
# It also sees .cache/integrations' packages (transformers, accelerate) through a second
# .pth file, a plain path line (that folder's own .pth files are not run again), written
# before the stamp, for the Hugging Face Trainer under DeepSpeed ZeRO-2
# (tests/deepspeed/test_hf_trainer_zero.py): the three share .venv's CPU torch, nothing
# is installed twice and pip never resolves one environment against the other.
DEEPSPEED_VENV ?= .cache/deepspeed
DEEPSPEED_STAMP := $(DEEPSPEED_VENV)/.cloudckpt-installed
$(DEEPSPEED_STAMP): $(STAMP) $(INTEGRATIONS_STAMP) tests/deepspeed/requirements.txt
	test -x $(DEEPSPEED_VENV)/bin/python || $(BIN)/python -m venv $(DEEPSPEED_VENV)
	$(INTEGRATIONS_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(DEEPSPEED_VENV)/bin/python -c \
		"import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz-cloudckpt-integrations.pth"
	$(call overlay-venv,$(DEEPSPEED_VENV),tests/deepspeed/requirements.txt,--no-deps)

test-deepspeed: $(DEEPSPEED_STAMP)
	$(DEEPSPEED_VENV)/bin/python -m pytest -q tests/deepspeed

# cloudckpt.ray against Ray Train 2.60 (tests/ray; docs/integrations.md) in .cache/ray,
# which sees .venv's packages (CPU torch, moto, the test servers) through a .pth file.
# ray[train] brings pyarrow and pandas, no torch (tests/ray/requirements.txt). The tests
# start Ray with 2 CPUs, no dashboard, and shut it down (about 5 min on 2 cores).
RAY_VENV ?= .cache/ray
RAY_STAMP := $(RAY_VENV)/.cloudckpt-installed
$(RAY_STAMP): $(STAMP) tests/ray/requirements.txt
	$(call overlay-venv,$(RAY_VENV),tests/ray/requirements.txt)

test-ray: $(RAY_STAMP)
	$(RAY_VENV)/bin/python -m pytest -q tests/ray

# Benchmarks against the peers (benchmarks/README.md). The peers' packages are
# installed here, not in the test environment: s3fs pulls an aiobotocore that pins an
# older botocore, so botocore is put back to the version the rest was tested with.
BENCH_STAMP := $(VENV)/.cloudckpt-bench-installed
$(BENCH_STAMP): $(STAMP)
	v=$$($(BIN)/python -c "import botocore; print(botocore.__version__)"); \
	$(BIN)/python -m pip install -q s3fs s3torchconnector multi-storage-client matplotlib \
	    runai-model-streamer runai-model-streamer-s3 && \
	$(BIN)/python -m pip install -q "botocore==$$v"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run --quick

lint: venv
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
