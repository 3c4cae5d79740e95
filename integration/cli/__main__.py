"""`python -m integration.cli`: the same as `dgr2`."""
import sys

from . import main

sys.exit(main())
