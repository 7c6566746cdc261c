#!/usr/bin/env python
"""``jf visualize``: see :mod:`megatron_jf.commands.visualize` (``python tools/visualize_trajectory.py --help``)."""
import sys

from megatron_jf.commands.visualize import main

if __name__ == "__main__":
    sys.exit(main())
