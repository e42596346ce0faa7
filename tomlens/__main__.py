"""`python -m tomlens`: the same as the `tomlens` command."""

import sys

from tomlens.cli import main

sys.exit(main())
