#!/usr/bin/env python
"""``jf evaluate``: see :mod:`megatron_jf.commands.evaluate` (``python tools/evaluate.py --help``)."""
import sys

from megatron_jf.commands.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
