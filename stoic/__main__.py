"""``python -m stoic serve ...``: the same as the ``stoic`` command."""

import sys

from ._entry import main

sys.exit(main())
