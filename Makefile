# Two commands: `make setup` then `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
DEBS := libibverbs1 librdmacm1 libnuma1
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup test patches-doc settings-doc fingerprints

setup:
	@# Mooncake's CPU wheel links against these; install only what is missing.
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e 'python[test]'
	$(VENV)/bin/sglang-dsv41 doctor

test:
	$(PY) -m pytest test -q -p no:cacheprovider

patches-doc:
	$(VENV)/bin/sglang-dsv41 patches-doc --write docs/PATCHES.md

settings-doc:
	$(VENV)/bin/sglang-dsv41 settings-doc --write README.md

fingerprints:
	$(VENV)/bin/sglang-dsv41 fingerprint --update
