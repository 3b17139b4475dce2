"""`python -m cbkit.cli`: the same as the `cbkit` command."""

import sys

from cbkit.cli import main

sys.exit(main())
