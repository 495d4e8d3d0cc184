"""The CI runner control plane: supervises one host's self-hosted runners and serves their API."""
