#!/usr/bin/env bash
# Install what OS isolation of generated code needs (megatron_jf/eval/sandbox.py): bubblewrap (`bwrap`) and, for
# an evaluator running as root whose interpreter the unprivileged sandbox uid cannot read, a system python3.
# Idempotent and quiet when both are present. Without root/apt it only says what is missing: the evaluator then
# refuses to execute generated code (unless told --unisolated) and the tests that need the sandbox skip.
set -euo pipefail
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
[ -x /usr/bin/python3 ] || need+=(python3)
if [ ${#need[@]} -eq 0 ]; then
  echo "[sandbox-deps] bubblewrap $(bwrap --version 2>/dev/null | awk '{print $2}') and /usr/bin/python3 present"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "[sandbox-deps] missing: ${need[*]} (install with: apt-get install -y ${need[*]})" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "[sandbox-deps] installing ${need[*]}"
apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
  || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
command -v bwrap >/dev/null 2>&1 && echo "[sandbox-deps] $(bwrap --version)"
