#!/usr/bin/env python
"""``jf generate``: see :mod:`megatron_jf.commands.generate` (``python tools/generate.py --help``)."""
import sys

from megatron_jf.commands.generate import main

if __name__ == "__main__":
    sys.exit(main())
