"""``verl ship``: evidence before traffic (docs/architecture.md §12). ``sequential`` holds the always-valid canary
statistics, ``simulate`` measures their error rates by simulation."""
