"""dpserve.plan: choose --tp / --dp with numbers. `python -m dpserve.plan --help`; docs/tuning.md."""
