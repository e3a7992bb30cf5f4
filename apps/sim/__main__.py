"""`uv run apps/sim`: simulate the async pipeline on a virtual clock (see `--help`)."""

from sim_app.cli import main

raise SystemExit(main())
