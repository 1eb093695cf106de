"""``python -m sidecar.cli``: the ``chainkv`` command without the installed console script."""

import sys

from sidecar.cli.main import main

sys.exit(main())
