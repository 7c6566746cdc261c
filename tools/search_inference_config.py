#!/usr/bin/env python
"""``jf search``: see :mod:`megatron_jf.commands.search` (``python tools/search_inference_config.py --help``)."""
import sys

from megatron_jf.commands.search import main

if __name__ == "__main__":
    sys.exit(main())
