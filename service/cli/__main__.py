"""``python -m slipstream.service.cli``: the ``slipstream`` command."""

import sys

from slipstream.service.cli import main

sys.exit(main())
