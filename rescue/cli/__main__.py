"""`python -m rescue.cli`."""

import sys

from rescue.cli import main

sys.exit(main())
