"""The history stores' contract suite, run on every backend (memory, SQLite, PostgreSQL, Redis)."""
