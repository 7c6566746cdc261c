#!/usr/bin/env bash
# The one-GPU check lives in bench/gpu/ (check.sh, check.py, decode_check.py); this name stays for the commands
# and launch notes that call it.
exec bash "$(dirname "$0")/gpu/check.sh" "$@"
