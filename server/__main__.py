"""``python -m rpcdist.programs.server``."""

from rpcdist.programs.server import main

raise SystemExit(main())
