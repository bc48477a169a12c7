"""Small shared helpers (files, logging)."""
