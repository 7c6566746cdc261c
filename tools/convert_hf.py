#!/usr/bin/env python
"""``jf convert``: see :mod:`megatron_jf.commands.convert` (``python tools/convert_hf.py --help``)."""
import sys

from megatron_jf.commands.convert import main

if __name__ == "__main__":
    sys.exit(main())
