PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# hypothesis: the derandomised profile, so that `make test` passes or fails the same on every run;
# HYPOTHESIS_PROFILE=dev make test explores new examples (tests/conftest.py)
HYPOTHESIS_PROFILE ?= ci
export HYPOTHESIS_PROFILE

.PHONY: demo test test-slow bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -c constraints.txt -e ".[test,demo,hf,docs,notebook]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (opake_fx .venv)" >/dev/null
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"
	$(PY) -m pytest -q --doctest-modules opake_fx

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) benchmarks/accounting.py
	$(PY) benchmarks/clipping.py --quick
	$(PY) benchmarks/architectures.py --quick
	$(PY) benchmarks/secure_noise.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
