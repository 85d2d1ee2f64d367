"""``python -m nimble``: the ``nimble`` command."""
import sys

from .cli.main import main

sys.exit(main())
