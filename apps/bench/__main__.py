"""`uv run apps/bench NAME`: run one benchmark (see `--list`)."""

from bench_app.cli import main

raise SystemExit(main())
