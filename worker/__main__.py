"""``python -m rpcdist.programs.worker``."""

from rpcdist.programs.worker import main

raise SystemExit(main())
