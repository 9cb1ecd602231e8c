#!/usr/bin/env bash
# What the browser tests (pytest -m browser) need beyond the Python dev extra: Debian's
# chromium. Idempotent: does nothing when /usr/bin/chromium is already there. Playwright
# itself comes with `pip install -e .[dev]` and is pointed at this binary, because
# downloading Playwright's own browser builds is not possible here.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  chromium fonts-liberation fonts-dejavu-core >/dev/null
/usr/bin/chromium --version
