"""``python -m clover_gguf.cli``: the ``clover-gguf`` command."""
import sys

from . import main

sys.exit(main())
