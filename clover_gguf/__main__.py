"""``python -m clover_gguf`` = the ``clover-gguf`` command."""
import sys

from .cli import main

sys.exit(main())
