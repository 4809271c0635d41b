"""``python -m imp_mem`` is the ``imp-mem`` command."""

from imp_mem.cli import main

raise SystemExit(main())
