#!/usr/bin/env python
"""``jf serve``: see :mod:`megatron_jf.commands.serve` (``python tools/run_text_generation_server.py --help``)."""
import sys

from megatron_jf.commands.serve import main

if __name__ == "__main__":
    sys.exit(main())
