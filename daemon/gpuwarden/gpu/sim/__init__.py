"""The simulated GPU backend: a test and demo instrument, never the production path."""
