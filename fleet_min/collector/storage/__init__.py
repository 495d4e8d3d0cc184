"""Storage: the SQLite schema (migrations) and backup and restore."""
