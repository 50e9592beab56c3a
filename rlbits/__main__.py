import sys

from rlbits.cli import main

sys.exit(main())
