import sys

from longreel.cli import main

sys.exit(main())
