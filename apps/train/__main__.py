"""`uv run apps/train`: the fully-async GRPO training run (see `--help`)."""

from train_app.cli import main

raise SystemExit(main())
