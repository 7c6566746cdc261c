#!/usr/bin/env python
"""``jf collect``: see :mod:`megatron_jf.commands.collect` (``python tools/generate_trajectories.py --help``)."""
import sys

from megatron_jf.commands.collect import main

if __name__ == "__main__":
    sys.exit(main())
