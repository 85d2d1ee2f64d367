"""``python -m nimble.cli``: the ``nimble`` command."""
import sys

from .main import main

sys.exit(main())
