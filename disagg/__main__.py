"""``python -m disagg`` works like the ``disagg`` console script."""

from disagg.cli import main

raise SystemExit(main())
