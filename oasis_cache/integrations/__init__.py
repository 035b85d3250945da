"""Opt-in integrations with other tools (imported explicitly; nothing here loads with `import oasis_cache`)."""
