"""The content-addressed artifact store: bytes on disk named by their SHA-256, and their rows."""
