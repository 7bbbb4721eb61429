"""``python -m stoic serve ...``: the same as the ``stoic`` command."""

import sys

from .cli import main

sys.exit(main())
