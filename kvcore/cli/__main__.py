"""``python -m kvcore.cli`` runs ``kvio``."""

import sys

from kvcore.cli import main

sys.exit(main())
